"""ggml's MUL_MAT_ID, the kernel llama.cpp's MoE layers run on the CPU (build_moe_ffn:
mul_mat_id for up and gate, silu * up, mul_mat_id for down, scaled by the routing weights
and summed over the chosen experts), through ctypes on the libggml-python wheel's libggml.
FP32 weights as GGML_TYPE_F32, BF16 weights as GGML_TYPE_BF16; activations stay FP32 as in
llama.cpp (BF16 inputs are widened, the output rounded back). The weights are used in place
(ggml_backend_cpu_buffer_from_ptr); one graph is built and planned per token count and
reused, on ggml's own threads (as many as torch's when the variant is prepared).
GGML_LIB_DIR names the folder holding libggml-base.so and libggml-cpu.so (default: the
installed libggml package's lib64)."""

import ctypes
import os

import numpy as np
import torch

from .common import Unsupported

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_TYPE_BF16 = 30

_lib = None


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class Cplan(ctypes.Structure):
    """struct ggml_cplan (ggml-cpu.h)."""
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool)]


def library():
    """libggml-base and libggml-cpu, loaded once, with the prototypes used here."""
    global _lib
    if _lib is not None:
        return _lib
    folder = os.environ.get("GGML_LIB_DIR")
    if not folder:
        try:
            import libggml
        except ImportError as e:
            raise Unsupported(f"libggml (libggml-python) does not import: {e}")
        folder = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    try:
        base = ctypes.CDLL(os.path.join(folder, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(os.path.join(folder, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise Unsupported(f"libggml does not load: {e}")
    P, I64, SZ, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int
    protos = {
        (base, "ggml_init"): (P, [InitParams]),
        (base, "ggml_free"): (None, [P]),
        (base, "ggml_new_tensor_2d"): (P, [P, I, I64, I64]),
        (base, "ggml_new_tensor_3d"): (P, [P, I, I64, I64, I64]),
        (base, "ggml_reshape_3d"): (P, [P, P, I64, I64, I64]),
        (base, "ggml_view_2d"): (P, [P, P, I64, I64, SZ, SZ]),
        (base, "ggml_mul_mat_id"): (P, [P, P, P, P]),
        (base, "ggml_mul"): (P, [P, P, P]),
        (base, "ggml_add"): (P, [P, P, P]),
        (base, "ggml_silu"): (P, [P, P]),
        (base, "ggml_new_graph"): (P, [P]),
        (base, "ggml_build_forward_expand"): (None, [P, P]),
        (base, "ggml_get_data"): (P, [P]),
        (base, "ggml_nbytes"): (SZ, [P]),
        (base, "ggml_backend_cpu_buffer_from_ptr"): (P, [P, SZ]),
        (base, "ggml_backend_tensor_alloc"): (I, [P, P, P]),
        (base, "ggml_backend_buffer_free"): (None, [P]),
        (cpu, "ggml_cpu_init"): (None, []),
        (cpu, "ggml_graph_plan"): (Cplan, [P, I, P]),
        (cpu, "ggml_graph_compute"): (I, [P, ctypes.POINTER(Cplan)]),
        (cpu, "ggml_cpu_has_avx2"): (I, []),
        (cpu, "ggml_cpu_has_avx512"): (I, []),
    }
    lib = type("Ggml", (), {})()
    for (so, name), (restype, argtypes) in protos.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(lib, name[len("ggml_"):], fn)
    lib.cpu_init()
    _lib = lib
    return lib


def version():
    from importlib.metadata import PackageNotFoundError, version as package_version
    lib = library()
    isa = "avx512" if lib.cpu_has_avx512() else "avx2" if lib.cpu_has_avx2() else "no-avx2"
    try:
        wheel = package_version("libggml-python")
    except PackageNotFoundError:
        wheel = "?"
    return f"libggml-python {wheel} ({isa})"


class _Graph:
    """The routed experts for one token count: inputs x [H, T], ids [k, T], routing weights
    [1, k, T] (all FP32/I32, written before each compute) and the output [H, T]; planned for
    `threads` threads with a work buffer of the size ggml_graph_plan asks for."""

    def __init__(self, lib, w, tensors, tokens, threads):
        H, F, k = w.hidden, w.ffn, w.top_k
        act_bytes = 4 * tokens * (H + 2 * k + 3 * k * F + 2 * k * H + 2 * H)
        self.ctx = lib.init(InitParams(act_bytes + act_bytes // 4 + (16 << 20), None, False))
        ctx = self.ctx
        self.x = lib.new_tensor_2d(ctx, GGML_TYPE_F32, H, tokens)
        self.ids = lib.new_tensor_2d(ctx, GGML_TYPE_I32, k, tokens)
        self.weights = lib.new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, tokens)
        cur = lib.reshape_3d(ctx, self.x, H, 1, tokens)
        up = lib.mul_mat_id(ctx, tensors["up"], cur, self.ids)  # [F, k, T]
        gate = lib.mul_mat_id(ctx, tensors["gate"], cur, self.ids)
        par = lib.mul(ctx, lib.silu(ctx, gate), up)
        experts = lib.mul_mat_id(ctx, tensors["down"], par, self.ids)  # [H, k, T]
        experts = lib.mul(ctx, experts, self.weights)
        out = None
        for i in range(k):  # llama.cpp sums the chosen experts through views
            view = lib.view_2d(ctx, experts, H, tokens, 4 * H * k, 4 * H * i)
            out = view if out is None else lib.add(ctx, out, view)
        self.out = out
        self.graph = lib.new_graph(ctx)
        lib.build_forward_expand(self.graph, out)
        self.plan = lib.graph_plan(self.graph, threads, None)
        self.work = np.empty(max(self.plan.work_size, 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data
        self.tokens, self.hidden, self.k = tokens, H, k

    def array(self, lib, tensor, dtype, shape):
        ptr = ctypes.cast(lib.get_data(tensor), ctypes.POINTER(np.ctypeslib.as_ctypes_type(dtype)))
        return np.ctypeslib.as_array(ptr, shape=shape)


def mul_mat_id(w, ggml_type):
    lib = library()
    ctx = lib.init(InitParams(1 << 20, None, True))
    tensors, buffers = {}, []
    held = {}
    for name, t in (("gate", w.gate), ("up", w.up), ("down", w.down)):
        t = t.contiguous()
        held[name] = t
        E, rows, cols = t.shape
        tensor = lib.new_tensor_3d(ctx, ggml_type, cols, rows, E)
        nbytes = t.numel() * t.element_size()
        if lib.nbytes(tensor) != nbytes:
            raise Unsupported(f"ggml sizes {name} at {lib.nbytes(tensor)} bytes, torch at {nbytes}")
        buf = lib.backend_cpu_buffer_from_ptr(t.data_ptr(), nbytes)
        if lib.backend_tensor_alloc(buf, tensor, t.data_ptr()) != 0:
            raise Unsupported(f"ggml_backend_tensor_alloc failed for {name}")
        buffers.append(buf)
        tensors[name] = tensor
    graphs = {}
    keep = (ctx, buffers, held, graphs)
    threads = torch.get_num_threads()

    def routed(x, topk_weights, topk_ids):
        T = x.shape[0]
        g = keep[3].get(T)
        if g is None:
            g = keep[3][T] = _Graph(lib, w, tensors, T, threads)
        g.array(lib, g.x, np.float32, (T, g.hidden))[:] = x.float().numpy()
        g.array(lib, g.ids, np.int32, (T, g.k))[:] = topk_ids.numpy()
        g.array(lib, g.weights, np.float32, (T, g.k))[:] = topk_weights.numpy()
        if lib.graph_compute(g.graph, ctypes.byref(g.plan)) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        y = torch.from_numpy(g.array(lib, g.out, np.float32, (T, g.hidden)).copy())
        return y.to(x.dtype)

    return routed


def fp32(w):
    return mul_mat_id(w, GGML_TYPE_F32)


def bf16(w):
    return mul_mat_id(w, GGML_TYPE_BF16)


VARIANTS = {
    "ggml-mul-mat-id-fp32": ("fp32", fp32),
    "ggml-mul-mat-id-bf16": ("bf16", bf16),
}
