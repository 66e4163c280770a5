"""Where the Kangaroo adapter runs: eager PyTorch, or its exported graph on the onnx backend's onnxruntime.

The drafter picks a runner by :attr:`Backend.runtime <kangaroo_core.interfaces.Backend.runtime>`; both keep their
own KV cache of the adapter's single attention layer and honour the :class:`~kangaroo_core.interfaces.DraftRunner`
contract (explicit ``start``, crop).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from kangaroo_backends.fast_layers import EXACT_ROWS, SmallBatchLinear, with_row_kernel
from kangaroo_backends.kv_cache import check_start
from kangaroo_backends.native import small_batch_kernel
from kangaroo_backends.ragged import exact_rows
from kangaroo_core.errors import KangarooError, OnnxExportError
from kangaroo_core.interfaces import Backend, DraftRunner
from kangaroo_plugins.kangaroo.adapter import DraftHead, KangarooAdapter, adapter_key


class TorchAdapterRunner(DraftRunner):
    """``head(adapter(h))`` in eager PyTorch; the drafting head (shared or draft-vocabulary rows) is resolved once.

    ``kernel``: the backend's small-batch kernel (:mod:`kangaroo_backends.fast_layers`), given where the backend
    verifies with it. The network's linear layers then compute each row alone, so a draft step merged across streams
    (:meth:`DeepContextTorchRunner.advance_many`) gives every stream exactly its own step's logits."""

    def __init__(self, adapter: KangarooAdapter, shared_head: torch.nn.Module, kernel=None):
        adapter = adapter.eval()
        self.kernel = kernel
        self.adapter = adapter if kernel is None else with_row_kernel(adapter, kernel)
        self.head = adapter.drafting_head(shared_head)
        if kernel is not None:
            if isinstance(self.head, DraftHead):
                self.head.kernel = kernel
            elif isinstance(self.head, torch.nn.Linear):
                self.head = SmallBatchLinear(self.head, kernel)
        self.cache = adapter.new_cache()

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    def fork(self) -> "TorchAdapterRunner":
        clone = copy.copy(self)  # the adapter and its drafting head are shared
        clone.cache = self.adapter.new_cache()
        return clone

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    @torch.inference_mode()
    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        check_start("adapter", start, self.length)
        out = self.adapter(hidden[None], start, self.cache)  # [1, n, d]
        return self.head(out[0, -1])  # [V]

    @torch.inference_mode()
    def advance_tree(self, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        """Tree nodes [m, d] at slots start.. → logits [m, V] (each node sees the prefix and its ancestors)."""
        check_start("adapter", start, self.length)
        out = self.adapter(hidden[None], start, self.cache, tree=tree)  # [1, m, d]
        return self.head(out[0])  # [m, V]

    @torch.inference_mode()
    def keep(self, positions) -> None:
        self.cache.keep(positions)


class _DeepContext:
    """What a deep-context runner remembers besides its KV cache: the layer-l states of the positions it has seen
    (to rewrite their keys/values when their deep states arrive) and the deep states verified so far.

    ``known``: positions 0..known-1 have deep states. Positions arrive in order (the engine's contract)."""

    def __init__(self, d: int, device, dtype):
        self.hidden = torch.empty(256, d, device=device, dtype=dtype)
        self.deep = torch.empty(256, d, device=device, dtype=dtype)
        self.known = 0

    def _fit(self, end: int) -> None:
        while end > self.hidden.shape[0]:
            for name in ("hidden", "deep"):
                old = getattr(self, name)
                new = torch.empty(2 * old.shape[0], old.shape[1], device=old.device, dtype=old.dtype)
                new[: old.shape[0]] = old
                setattr(self, name, new)

    def store_hidden(self, hidden: torch.Tensor, start: int) -> None:
        self._fit(start + hidden.shape[0])
        self.hidden[start:start + hidden.shape[0]] = hidden

    def store_deep(self, deep: torch.Tensor, start: int) -> None:
        if start > self.known:
            raise KangarooError(f"deep states must arrive in order: got position {start}, expected {self.known}")
        self._fit(start + deep.shape[0])
        self.deep[start:start + deep.shape[0]] = deep
        self.known = start + deep.shape[0]

    def keep(self, positions: list[int]) -> None:
        """Keep the layer-l states of these slots (ascending), compacted to the front (a tree round's accepted path;
        the deep states are only ever known for committed positions, which stay where they are)."""
        index = torch.as_tensor(positions, dtype=torch.long, device=self.hidden.device)
        self.hidden[: len(positions)] = self.hidden.index_select(0, index)

    def known_mask(self, start: int, n: int) -> torch.Tensor:
        """[n, 1]: 1.0 where position start+i has a deep state."""
        index = torch.arange(start, start + n, device=self.hidden.device)
        return (index < self.known).to(self.hidden.dtype)[:, None]

    def deep_rows(self, start: int, n: int) -> torch.Tensor:
        """Deep states of positions start..start+n-1 (zeros where unknown)."""
        rows = torch.zeros(n, self.deep.shape[1], device=self.deep.device, dtype=self.deep.dtype)
        end = min(self.known, start + n)
        if end > start:
            rows[: end - start] = self.deep[start:end]
        return rows

    def latest(self) -> torch.Tensor:
        """z_{known-1} (zeros before any deep state) [d]."""
        return self.deep[self.known - 1] if self.known else torch.zeros_like(self.deep[0])


class DeepContextTorchRunner(TorchAdapterRunner):
    """The deep-context adapter in eager PyTorch: keys/values of verified positions are (re)computed from
    ``h + W_kv z`` as soon as their deep states arrive; the query reads the latest verified deep state.

    Several streams' draft steps run as one (:meth:`advance_many`, a batch's merged draft pass): their rows go
    through every linear layer together and attend stream by stream over their own caches."""

    def __init__(self, adapter, shared_head: torch.nn.Module, kernel=None):
        super().__init__(adapter, shared_head, kernel)
        param = next(adapter.parameters())
        self.context = _DeepContext(adapter.config.hidden_size, param.device, param.dtype)

    def fork(self) -> "DeepContextTorchRunner":
        clone = super().fork()
        clone.context = _DeepContext(self.context.hidden.shape[1], self.context.hidden.device, self.context.hidden.dtype)
        return clone

    def reset(self) -> None:
        super().reset()
        self.context.known = 0

    def _write(self, start: int, n: int, positions: torch.Tensor | None = None) -> None:
        """Append keys/values of slots start..start+n-1 (the cache holds exactly start slots); RoPE at
        ``positions`` (default: the slots themselves; a tree's nodes sit at their depth's position)."""
        self._write_many([(self, start, n, positions)])

    def _write_many(self, spans) -> None:
        """:meth:`_write` for each ``(runner, start, n, positions)`` (forks of this runner), their rows together."""
        a = self.adapter
        y = a.kv_input(torch.cat([r.context.hidden[s:s + n] for r, s, n, _ in spans]),
                       torch.cat([r.context.deep_rows(s, n) for r, s, n, _ in spans]),
                       torch.cat([r.context.known_mask(s, n) for r, s, n, _ in spans]))
        k, v = a.keys_values(y[None], torch.cat([torch.arange(s, s + n, device=y.device) if p is None else p
                                                 for _, s, n, p in spans]))
        lo = 0
        for runner, _, n, _ in spans:
            runner.cache.update(k[:, :, lo:lo + n], v[:, :, lo:lo + n], 0)
            lo += n

    @torch.inference_mode()
    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        return self._steps([(self, hidden, start)])[0]

    @torch.inference_mode()
    def advance_many(self, calls: Sequence[tuple["DeepContextTorchRunner", torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each ``(runner, hidden, start)``'s :meth:`advance` (runners forked from this one: the same network), in
        one pass where that is exact: with the row kernel, the calls of up to :data:`EXACT_ROWS` new rows run
        together (every row alone in the linear layers, attention per stream); the rest run one by one."""
        if self.kernel is None or len(calls) == 1:
            return [runner.advance(hidden, start) for runner, hidden, start in calls]
        # a call of many rows (a prompt) runs alone, a GEMM over its rows as when it runs alone; the rest together
        logits = [runner.advance(hidden, start) if hidden.shape[0] > EXACT_ROWS else None
                  for runner, hidden, start in calls]
        merged = [i for i, row in enumerate(logits) if row is None]
        if merged:
            with exact_rows():
                for i, row in zip(merged, self._steps([calls[i] for i in merged])):
                    logits[i] = row
        return logits

    def _steps(self, calls) -> list[torch.Tensor]:
        """The draft step of every call, their rows together: keys/values of the new positions into each runner's
        cache, then one query per runner (its last position) → next-token logits [V] each."""
        a = self.adapter
        for runner, _, start in calls:  # every start checked before any stream's state moves
            check_start("adapter", start, runner.length)
        for runner, hidden, start in calls:
            runner.context.store_hidden(hidden, start)
        self._write_many([(runner, start, hidden.shape[0], None) for runner, hidden, start in calls])
        device = calls[0][1].device
        last = torch.tensor([start + hidden.shape[0] - 1 for _, hidden, start in calls], device=device)  # queries
        depth = last - torch.tensor([runner.context.known for runner, _, _ in calls], device=device)
        x_q = a.query_input(torch.cat([hidden[-1:] for _, hidden, _ in calls]),
                            torch.stack([runner.context.latest() for runner, _, _ in calls]), depth)  # [S, d]
        q = a.queries(x_q[None], last)  # [1, H, S, hd]
        attended = [a.attend_one(q[:, :, i:i + 1], *runner.cache.layer(0)) for i, (runner, _, _) in enumerate(calls)]
        out = a.finish(x_q[None], torch.cat(attended, dim=2))  # [1, S, d]
        return list(self.head(out[0]))  # S x [V]

    @torch.inference_mode()
    def advance_tree(self, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        """Tree nodes [m, d] at slots start..: none has a deep state, so their keys are plain; each query reads
        the latest verified deep state and its own draft depth (position − verified positions)."""
        check_start("adapter", start, self.length)
        a, c, m = self.adapter, self.context, hidden.shape[0]
        positions = tree.position_ids(hidden.device)
        c.store_hidden(hidden, start)
        self._write(start, m, positions)
        depth = positions - c.known
        x_q = a.query_input(hidden, c.latest()[None].expand(m, -1), depth)  # [m, d]
        keys, values = self.cache.layer(0)
        out = a.attend_masked(x_q[None], positions, keys, values, tree.allowed(start + m, hidden.device))
        return self.head(out[0])  # [m, V]

    @torch.inference_mode()
    def keep(self, positions) -> None:
        """Keep these slots of the cache and of the remembered layer-l states (the accepted tree path)."""
        positions = list(positions)
        self.context.keep(positions)
        self.cache.keep(positions)

    @torch.inference_mode()
    def observe_deep(self, start: int, deep: torch.Tensor) -> None:
        """Record z of positions start..; rewrite the keys/values of those already in the cache (no target work:
        one key/value projection of the accepted positions)."""
        c = self.context
        c.store_deep(deep.to(c.deep.dtype), start)
        seen = self.length
        if start < seen:
            self.cache.crop(start)
            self._write(start, seen - start)


def _block_activations(backend) -> str | None:
    """``int8`` / ``float32`` when the backend multiplies on kangaroo's block kernel (the adapter graph then does too,
    at the same activations), else None."""
    if getattr(backend, "kernel", None) != "blocks":
        return None
    from kangaroo_backends.block_weights import activations_at

    return activations_at(backend.accuracy_level)


class OnnxAdapterRunner(DraftRunner):
    """The exported adapter graph (see :mod:`kangaroo_plugins.kangaroo.onnx_graph`) on the backend's onnxruntime;
    exported once per (base model, exit layer, adapter) into the backend's artefact directory."""

    def __init__(self, backend: Backend, adapter: KangarooAdapter, adapter_path: str | None, *, opset: int,
                 tolerance: float):
        from kangaroo_plugins.kangaroo.onnx_graph import GRAPH_FILE, MANIFEST, export_adapter_graph, graph_io, read_adapter_manifest

        key = adapter_key(adapter_path)
        directory = backend.artifact_dir() / "kangaroo" / f"l{backend.exit_layer}-{key}"
        if not (directory / MANIFEST).is_file():
            try:
                export_adapter_graph(adapter, backend.shared_head(), directory, fingerprint=backend.fingerprint,
                                     exit_layer=backend.exit_layer, key=key, opset=opset, tolerance=tolerance,
                                     quiet=getattr(backend, "quiet", False), blocks=_block_activations(backend))
            except OSError as exc:  # e.g. a read-only bundle exported without this adapter
                raise OnnxExportError(f"cannot export the adapter graph into {directory}: {exc}; export the bundle "
                                      f"with this adapter (`kangaroo export-onnx --adapter DIR`)") from None
        read_adapter_manifest(directory, fingerprint=backend.fingerprint, exit_layer=backend.exit_layer, key=key)
        inputs, outputs = graph_io(adapter)
        self.graph = backend.open_graph(directory / GRAPH_FILE, inputs, outputs, kv_layers=1)
        self.hidden_size, self.vocab_size, self.device = backend.hidden_size, backend.vocab_size, backend.device

    @property
    def length(self) -> int:
        return self.graph.length

    def fork(self) -> "OnnxAdapterRunner":
        clone = copy.copy(self)  # the session is shared
        clone.graph = self.graph.fork()
        return clone

    def reset(self) -> None:
        self.graph.reset()

    def crop(self, length: int) -> None:
        self.graph.crop(length)

    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        check_start("adapter", start, self.length)
        x = hidden.to(device=self.device, dtype=torch.float32)[None].contiguous()
        rows = torch.tensor([x.shape[1] - 1])  # a chain drafts from its last row
        (logits,) = self.graph.run(x, [(1, 1, self.vocab_size)], {"logit_rows": rows})
        return logits[0, 0]  # [V]

    def advance_tree(self, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        """Tree nodes [m, d] at slots start.. → logits [m, V] (each node sees the prefix and its ancestors)."""
        check_start("adapter", start, self.length)
        x = hidden.to(device=self.device, dtype=torch.float32)[None].contiguous()
        m = x.shape[1]
        (logits,) = self.graph.run(x, [(1, m, self.vocab_size)], {"logit_rows": torch.arange(m)}, tree=tree)
        return logits[0]

    def keep(self, positions) -> None:
        self.graph.keep(list(positions))


class DeepContextOnnxRunner(OnnxAdapterRunner):
    """The deep-context adapter's graph on onnxruntime; the same bookkeeping as :class:`DeepContextTorchRunner`,
    except when keys/values are rewritten: the graph computes them only by running whole (its FFN and head
    included), so the slots whose deep states arrive are dropped from its cache and rewritten by the next call,
    together with that call's own rows — one graph run per draft step, none after a verify pass."""

    def __init__(self, backend: Backend, adapter, adapter_path: str | None, *, opset: int, tolerance: float):
        super().__init__(backend, adapter, adapter_path, opset=opset, tolerance=tolerance)
        self.context = _DeepContext(self.hidden_size, self.device, torch.float32)
        self.slots = 0  # positions seen; the graph's cache holds the first graph.length of them

    @property
    def length(self) -> int:
        return self.slots

    def fork(self) -> "DeepContextOnnxRunner":
        clone = super().fork()
        clone.context = _DeepContext(self.hidden_size, self.device, torch.float32)
        clone.slots = 0
        return clone

    def reset(self) -> None:
        super().reset()
        self.context.known, self.slots = 0, 0

    def crop(self, length: int) -> None:
        super().crop(length)
        self.slots = min(self.slots, length)

    def catch_up(self) -> None:
        """Run the slots whose keys/values wait to be (re)written (a tree round needs them in the cache)."""
        start = self.graph.length
        if start < self.slots:
            self._run(start, self.slots - start)

    def _run(self, start: int, n: int, tree=None) -> torch.Tensor:
        """Append slots start..start+n-1; a chain call drafts from its last row ([1, V] logits), a tree call from
        every node ([n, V]: node i at the tree's position, reading the prefix and its ancestors)."""
        c = self.context
        if tree is None:
            rows, depth = torch.tensor([n - 1]), torch.tensor([start + n - 1 - c.known])
            bias = torch.zeros(1, 1, 1, start + n, device=self.device)  # a chain's query reads every key
        else:
            positions = tree.position_ids()
            rows, depth = torch.arange(n), positions - c.known
            bias = tree.additive_mask(start + n, torch.float32, self.device)
        extra = {"deep": c.deep_rows(start, n)[None], "known": c.known_mask(start, n)[None],
                 "latest_deep": c.latest()[None], "query_rows": rows, "depth": depth, "query_bias": bias}
        (logits,) = self.graph.run(c.hidden[start:start + n][None], [(1, len(rows), self.vocab_size)], extra, tree=tree)
        return logits[0]

    def advance(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """The slots waiting to be rewritten and the new ones in one run; logits of the last [V]."""
        check_start("adapter", start, self.length)
        self.context.store_hidden(hidden.to(device=self.device, dtype=torch.float32), start)
        self.slots = start + hidden.shape[0]
        first = self.graph.length
        return self._run(first, self.slots - first)[0]  # [V]

    def advance_tree(self, hidden: torch.Tensor, start: int, tree) -> torch.Tensor:
        """Tree nodes [m, d] at slots start..: none has a deep state (plain keys); each query reads the latest
        verified deep state and its own draft depth, as :class:`DeepContextTorchRunner` does."""
        check_start("adapter", start, self.length)
        self.catch_up()
        self.context.store_hidden(hidden.to(device=self.device, dtype=torch.float32), start)
        self.slots = start + hidden.shape[0]
        return self._run(start, hidden.shape[0], tree)  # [m, V]

    def keep(self, positions) -> None:
        """Keep these slots of the cache and of the remembered layer-l states (the accepted tree path)."""
        positions = list(positions)
        self.catch_up()
        self.context.keep(positions)
        self.graph.keep(positions)
        self.slots = self.graph.length

    def observe_deep(self, start: int, deep: torch.Tensor) -> None:
        """Record z of positions start..; the keys/values of those already in the cache wait for the next run."""
        self.context.store_deep(deep.to(device=self.device, dtype=torch.float32), start)
        self.graph.crop(start)


def make_runner(backend: Backend, adapter: KangarooAdapter, adapter_path: str | None, *, opset: int,
                tolerance: float) -> DraftRunner:
    """The runner for ``backend.runtime``; a one-line error for a runtime the drafter cannot run on."""
    if backend.runtime == "torch":
        if adapter.reads_deep_states:  # the runner that merges a batch's steps: its rows computed alone, where it can
            param = next(adapter.parameters())
            exact = getattr(backend, "kernels", None) == "small-batch" and param.dtype == torch.float32
            kernel = small_batch_kernel()[0] if exact and param.device.type == "cpu" else None
            return DeepContextTorchRunner(adapter, backend.shared_head(), kernel)
        return TorchAdapterRunner(adapter, backend.shared_head())
    if backend.runtime == "onnxruntime":
        if adapter.reads_deep_states:
            return DeepContextOnnxRunner(backend, adapter, adapter_path, opset=opset, tolerance=tolerance)
        return OnnxAdapterRunner(backend, adapter, adapter_path, opset=opset, tolerance=tolerance)
    raise KangarooError(f"the kangaroo drafter runs on the torch or onnxruntime runtimes, not on the '{backend.name}' "
                        f"backend's runtime '{backend.runtime}'")
