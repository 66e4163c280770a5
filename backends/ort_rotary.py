"""The rotary position embedding of an exported graph as one node per projection (``kangaroo.Rotary``, CPU).

Why: torch's export writes ``x * cos + rotate_half(x) * sin`` for the queries and for the keys of every layer as
small nodes (the heads' Reshape, the Unsqueeze of the shared cos and sin, four Mul, two MatMul by a ±1 matrix, two
Add), and on a one-row pass onnxruntime's cost per node is most of what they take (docs/backends.md, "Fewer nodes
and bindings per pass"). The op computes the same products and sums, rounded the same way, so a graph gives the same
bits with or without it.

The rewrite runs when a graph is loaded (as :func:`~kangaroo_backends.ort_attention.swap_attention` does), so
exports already on disk gain it too; a graph without the pattern is left as it is.
"""

from __future__ import annotations

import numpy as np

from kangaroo_backends.onnx_toolkit import rotate_half_matrix
from kangaroo_backends.ort_attention import DOMAIN, _live

OP = "Rotary"


def fuse_rotary(proto) -> int:
    """Replace every ``x * cos + (x @ R) * sin`` (R: :func:`~kangaroo_backends.onnx_toolkit.rotate_half_matrix`, cos
    and sin broadcast over the heads by an Unsqueeze) in an ``onnx.ModelProto`` (changed in place) by one
    ``kangaroo.Rotary`` node, which also takes over the Reshape that split x's heads where nothing else reads it;
    returns how many were replaced."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    producer = {out: node for node in graph.node for out in node.output}
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def made_by(name: str, op: str):
        node = producer.get(name)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def broadcast_source(name: str) -> str | None:
        """cos / sin [.., n, D] where ``name`` is its Unsqueeze to [.., n, 1, D]."""
        node = made_by(name, "Unsqueeze")
        if node is None:
            return None
        axes = values.get(node.input[1]) if len(node.input) > 1 else None
        # [.., n, D] -> [.., n, 1, D]: the heads axis, the layout the op reads ([.., n, H, D], heads inside rows)
        return node.input[0] if axes is not None and axes.size == 1 and int(axes.reshape(-1)[0]) in (2, -2) else None

    def match(add) -> tuple[str, str, str, int] | None:
        """(x, cos, sin, D) when ``add`` sums x * cos and (x @ R) * sin, in either order."""
        for first, second in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
            direct, rotated = made_by(first, "Mul"), made_by(second, "Mul")
            if direct is None or rotated is None:
                continue
            for x, cos in ((direct.input[0], direct.input[1]), (direct.input[1], direct.input[0])):
                for product, sin in ((rotated.input[0], rotated.input[1]), (rotated.input[1], rotated.input[0])):
                    matmul = made_by(product, "MatMul")
                    if matmul is None or matmul.input[0] != x:
                        continue
                    r = values.get(matmul.input[1])
                    if r is None or r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] % 2 or not np.array_equal(
                            r, rotate_half_matrix(r.shape[0]).numpy()):
                        continue
                    cos_source, sin_source = broadcast_source(cos), broadcast_source(sin)
                    if cos_source is not None and sin_source is not None:
                        return x, cos_source, sin_source, r.shape[0]
        return None

    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1

    def unsplit(x: str, d: int) -> str | None:
        """[.., n, H * D] where ``x`` is its Reshape to [.., n, H, D] that only this rotation reads."""
        node = made_by(x, "Reshape")
        shape = values.get(node.input[1]) if node is not None else None
        if shape is None or shape.ndim != 1 or len(shape) < 3 or shape[-1] != d or shape[-2] <= 0 or readers.get(x) != 2:
            return None
        return node.input[0]

    nodes, fused = [], 0
    for node in graph.node:
        found = match(node) if node.op_type == "Add" and node.domain in ("", "ai.onnx") else None
        if found is None:
            nodes.append(node)
            continue
        x, cos, sin, d = found
        whole = unsplit(x, d)
        nodes.append(helper.make_node(OP, [whole or x, cos, sin], list(node.output), name=f"{node.name}/{OP}",
                                      domain=DOMAIN, split_heads=int(whole is not None)))
        fused += 1
    if fused:
        del graph.node[:]
        graph.node.extend(_live(nodes, {o.name for o in graph.output}))
        if not any(o.domain == DOMAIN for o in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return fused
