"""Every Triton kernel compiles for an H100 (sm_90) down to a cubin, with the constexprs and warps it gets at
Llama 3 8B's shapes, on this CPU machine (Triton's compiler and ptxas need no GPU). The interpreter, which the
other kernel tests run, executes the kernels' Python and so misses what only the compiler checks (constexpr
expressions, types of loop-carried values, layouts); this catches that before any GPU time is spent. Whether
they run fast is bench/kernels_tune.py's question, on a GPU."""
import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

R = importlib.import_module("trainyard.kernels.rmsnorm")
S = importlib.import_module("trainyard.kernels.swiglu")
P = importlib.import_module("trainyard.kernels.rope")
C = importlib.import_module("trainyard.kernels.cross_entropy")


def _has_cuda_backend() -> bool:
    try:
        from triton.backends import backends
        return "nvidia" in backends
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(not _has_cuda_backend(), reason="this Triton has no NVIDIA backend")


def _ints(names: str, ptr_type: str = "*bf16") -> dict:
    return {n: (ptr_type if n.endswith("_ptr") else "i32") for n in names.split()}


ROPE_QK = _ints("q_ptr k_ptr qo_ptr ko_ptr cos_ptr sin_ptr seq q_heads k_heads half sq_b sq_s sq_h sq_d sk_b sk_s "
                "sk_h sk_d sqo_b sqo_s sqo_h sqo_d sko_b sko_s sko_h sko_d sc_b sc_s sc_p ss_b ss_s ss_p")
ROPE = _ints("x_ptr out_ptr cos_ptr sin_ptr seq heads half sx_b sx_s sx_h sx_d so_b so_s so_h so_d sc_b sc_s sc_p "
             "ss_b ss_s ss_p")
KERNELS = {
    "rms_norm forward, 2 rows": (R._rms_norm_fwd_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32",
                                                         "M": "i32", "N": "i32", "eps": "fp32"},
                                 {"BLOCK": 4096, "ROWS": 2, "X64": False, "Y64": False}, 8),
    "rms_norm backward": (R._rms_norm_bwd_kernel, {"DY": "*bf16", "X": "*bf16", "W": "*bf16", "RSTD": "*fp32",
                                                   "DX": "*bf16", "DW_PARTIAL": "*fp32", "M": "i32", "N": "i32",
                                                   "rows_per_program": "i32"}, {"BLOCK": 4096, "X64": False}, 8),
    "swiglu forward": (S._swiglu_fwd_kernel, {"A": "*bf16", "B": "*bf16", "OUT": "*bf16", "n": "i64"},
                       {"BLOCK": 4096, "F64": False}, 16),
    "swiglu backward": (S._swiglu_bwd_kernel, {"DOUT": "*bf16", "A": "*bf16", "B": "*bf16", "DA": "*bf16",
                                               "DB": "*bf16", "n": "i64"}, {"BLOCK": 1024, "F64": False}, 4),
    "rope q and k, hf, backward": (P._rope_qk_kernel, ROPE_QK, {"INTERLEAVED": False, "INVERSE": True, "F64": False,
                                                                "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_P": 64}, 4),
    "rope one tensor, pairs": (P._rope_kernel, ROPE, {"INTERLEAVED": True, "INVERSE": False, "F64": False,
                                                      "BLOCK_H": 32, "BLOCK_P": 64}, 8),
    "cross-entropy rows": (C._ce_rows_kernel, {"LOGITS": "*bf16", "stride_row": "i64", "TARGETS": "*i64",
                                               "SCALE": "*fp32", "stride_scale": "i32", "LOSSES": "*fp32", "V": "i32",
                                               "ignore_index": "i32"},
                           {"GRAD": True, "BLOCK": 32768, "MATH": tl.float32}, 32),
}


def compile_all() -> dict:
    """{kernel: "ok" or its error}, each compiled for sm_90 (run in a process without TRITON_INTERPRET)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for name, (fn, signature, constexprs, warps) in KERNELS.items():
        try:
            src = ASTSource(fn=triton.jit(fn), signature={**signature, **{c: "constexpr" for c in constexprs}},
                            constexprs=constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            assert compiled.asm["cubin"] and compiled.metadata.num_warps == warps
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001  (reported per kernel)
            out[name] = f"{type(e).__name__}: {e}"[:2000]
    return out


def test_every_kernel_compiles_for_sm90():
    """In a fresh process without TRITON_INTERPRET: the switch, read when Triton is imported, turns its own
    library functions (tl.sum, ...) into the interpreter's, which the compiler cannot take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", "import json; from tests.kernels.test_gpu_compile import compile_all; "
                           "print(json.dumps(compile_all()))"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == set(KERNELS)
    assert all(v == "ok" for v in got.values()), {k: v for k, v in got.items() if v != "ok"}
