"""python THIS THREADS. MatMulNBits (4-bit, block 32) at accuracy 1 vs 4 vs float32 MatMul, M rows, SmolLM2 shapes, 1 thread."""
import time, sys
import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
K, N = 576, 1536
def model(kind, level=1):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K]); y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])
    rng = np.random.default_rng(0)
    if kind == "f32":
        w = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w")
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]; inits = [w]; ops = [helper.make_opsetid("", 17)]
    else:
        blocks = K // 32
        codes = numpy_helper.from_array(rng.integers(0, 255, (N, blocks, 16), dtype=np.uint8), "c")
        scales = numpy_helper.from_array(rng.random(N * blocks).astype(np.float32), "s")
        zp = numpy_helper.from_array(np.full((N * ((blocks + 1) // 2),), 0x88, np.uint8), "z")
        nodes = [helper.make_node("MatMulNBits", ["x", "c", "s", "z"], ["y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=32, accuracy_level=level)]
        inits = [codes, scales, zp]; ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(g, opset_imports=ops).SerializeToString()
o = ort.SessionOptions(); o.intra_op_num_threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
for m in (1, 4, 16, 120, 773):
    x = np.random.default_rng(1).standard_normal((m, K)).astype(np.float32)
    row = []
    for kind, level in (("f32", 0), ("nb", 1), ("nb", 4)):
        s = ort.InferenceSession(model(kind, level), o, providers=["CPUExecutionProvider"])
        for _ in range(3): s.run(None, {"x": x})
        reps = max(3, int(2000 / m)); t = time.perf_counter()
        for _ in range(reps): s.run(None, {"x": x})
        dt = (time.perf_counter() - t) / reps
        row.append(f"{kind}{level if kind == 'nb' else ''} {dt*1e3:7.3f} ms {2*m*K*N/dt/1e9:6.1f} G/s")
    print(f"m={m:4d}  " + "  |  ".join(row))
