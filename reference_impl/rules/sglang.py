"""SGLang's NVFP4 W4A16 configuration rules (docs/contracts.md section 4), as small pure functions.

Written from docs/contracts.md section 4 and the pinned SGLang 0.5.23 code it points to (where they differ the code
wins; each such point is marked ``CODE:``). Every function takes plain strings and returns plain values, or
raises the exception type the engine raises, with a message carrying the engine's wording.

Environment variables are given as ``"unset"`` or the string the variable is set to (the matrices use
``"0"``/``"1"``; the ``env_flags`` matrix other spellings, see :func:`env_true`); SGLang distinguishes *unset*
from *set to false* for ``SGLANG_MOE_NVFP4_DISPATCH`` (``is_set()`` versus ``get()``), so we keep both.

Rule profiles: the functions whose rule changed upstream after 0.5.23 take ``profile`` (one of
:data:`PROFILES`). ``sglang-0.5.23`` is the pinned release; ``sglang-main`` is SGLang's main branch on the
rules its own tests pin differently (``MAIN:`` marks each; sources in fixtures/config_rules/profiles/).
"""
from __future__ import annotations

DEFAULT_PROFILE = "sglang-0.5.23"
PROFILES = (DEFAULT_PROFILE, "sglang-main")

FP4_GEMM_BACKENDS = ("auto", "flashinfer_cudnn", "flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_trtllm", "marlin")
PLATFORMS = ("sm100", "sm90", "cpu")
FP4_BACKEND_PLATFORMS = ("sm100", "sm90", "sm120", "sm121", "cpu")  # sm120/sm121: RTX/GB10-class Blackwell
QUANT_ALGOS = ("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4", "FP8")
NVFP4_MOE_RUNNERS = ("flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed")
A2A_BACKENDS = ("none", "deepep", "flashinfer")
DEEPEP_MODES = ("auto", "low_latency", "normal")
DISPATCH_TYPES = ("none", "auto", "bf16", "nvfp4", "mxfp8")
QUANTIZATIONS = ("modelopt_fp4", "mxfp8", "bf16")
ENV_VALUES = ("unset", "0", "1")  # the values the matrices combine
# CODE (sglang.srt.environ.EnvBool.parse, case-insensitive): the spellings of true and false. Any other value
# is invalid: SGLang warns and uses the variable's default (False for every flag these rules read).
ENV_TRUE_SPELLINGS = ("true", "1", "yes", "y")
ENV_FALSE_SPELLINGS = ("false", "0", "no", "n")


class RejectedEarlier(Exception):
    """Wraps an engine error raised by a check unrelated to W4A16/dispatch (runner/quantization compatibility).
    ``error`` is the exception the engine raises."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ValueError(f"unknown rules profile {profile!r}: use one of {PROFILES}")
    return profile


def env_true(value: str) -> bool:
    """An SGLang boolean env flag's value: ``"unset"`` or the string it is set to (see ENV_TRUE_SPELLINGS)."""
    if not isinstance(value, str):
        raise TypeError(f"env value must be a string ('unset' or the variable's text), got {value!r}")
    return value != "unset" and value.lower() in ENV_TRUE_SPELLINGS


# ---- dense -----------------------------------------------------------------------------------------------

def resolve_fp4_gemm_backend(backend: str, platform: str, profile: str = DEFAULT_PROFILE) -> str:
    """``--fp4-gemm-backend auto`` resolves by platform (CODE: fp4_utils.initialize_fp4_gemm_config):
    SM100 -> flashinfer_cutedsl, SM80..SM9x -> marlin, anything else -> flashinfer_cutlass. An explicit
    choice is kept on every platform.
    MAIN: SM120 and SM121 ``auto`` -> flashinfer_b12x (FlashInfer's SM12x dense NVFP4 GEMM, API name b12x)."""
    check_profile(profile)
    if backend not in FP4_GEMM_BACKENDS:
        raise ValueError(f"unknown FP4 GEMM backend {backend!r}")
    if backend != "auto":
        return backend
    if profile == "sglang-main" and platform in ("sm120", "sm121"):
        return "flashinfer_b12x"
    return {"sm100": "flashinfer_cutedsl", "sm90": "marlin"}.get(platform, "flashinfer_cutlass")


def dense_linear_method(quant_algo: str, env_w4a16: str, resolved_backend: str) -> tuple[str, str | None]:
    """(linear method class name, quant_mode) for a non-excluded linear layer under ``modelopt_fp4``.

    docs/contracts.md section 4: ``w4a16`` iff the env flag is true AND the (resolved) FP4 GEMM backend is flashinfer_cutedsl.
    CODE: W4A16_NVFP4 checkpoints use ModelOptNvFp4A16LinearMethod (no quant_mode); an FP8 (non-NVFP4)
    checkpoint keeps dense layers unquantized."""
    if quant_algo not in QUANT_ALGOS:
        raise ValueError(f"ModelOpt currently only supports: {', '.join(QUANT_ALGOS)}")
    if "NVFP4" not in quant_algo:
        return "UnquantizedLinearMethod", None
    if quant_algo == "W4A16_NVFP4":
        return "ModelOptNvFp4A16LinearMethod", None
    w4a16 = env_true(env_w4a16) and resolved_backend == "flashinfer_cutedsl"
    return "ModelOptFp4LinearMethod", ("w4a16" if w4a16 else "w4a4")


def flashinfer_backend_name(backend: str) -> str:
    """SGLang name -> FlashInfer API backend name (flashinfer_cutedsl -> cute-dsl, flashinfer_X -> X)."""
    if backend == "flashinfer_cutedsl":
        return "cute-dsl"
    return backend.removeprefix("flashinfer_")


def fp4_gemm_kernel(quant_mode: str, backend: str) -> tuple[str, str]:
    """Which FlashInfer entry point the FP4 GEMM op calls: ``mm_fp4`` (w4a4) or ``mm_bf16_fp4`` (w4a16);
    anything else raises ValueError (docs/contracts.md section 4)."""
    if quant_mode == "w4a4":
        return "mm_fp4", flashinfer_backend_name(backend)
    if quant_mode == "w4a16":
        return "mm_bf16_fp4", flashinfer_backend_name(backend)
    raise ValueError(f"Unsupported FlashInfer FP4 GEMM quant mode: {quant_mode}")


# ---- MoE server arguments ----------------------------------------------------------------------------------

MXFP8_MOE_RUNNERS = ("cutlass", "deep_gemm", "flashinfer_megamoe", "flashinfer_trtllm", "flashinfer_trtllm_routed")


def resolve_moe_runner(runner: str, quantization: str) -> str:
    """CODE (overrides._moe_runner_backend_quant_constraints): under ``--quantization mxfp8`` a runner outside
    the MXFP8 list is replaced (with a warning) by flashinfer_trtllm."""
    if quantization == "mxfp8" and runner not in MXFP8_MOE_RUNNERS:
        return "flashinfer_trtllm"
    return runner


def check_moe_kernel_config(runner: str, quantization: str) -> None:
    """Runner/quantization compatibility, checked before any A2A rule (CODE: moe_hook.handle_moe_kernel_config).
    Raises :class:`RejectedEarlier` wrapping the engine's AssertionError."""
    quant = None if quantization == "bf16" else quantization
    allowed = {
        "flashinfer_cutlass": ("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None),
        "flashinfer_cutedsl": ("modelopt_fp4", "modelopt_mixed", "nvfp4_online"),
        "flashinfer_trtllm": ("modelopt_fp4", "nvfp4_online", "fp8", "mxfp8", "modelopt_fp8", "modelopt_mixed",
                              "compressed-tensors", None),
        "flashinfer_trtllm_routed": ("fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed", "nvfp4_online",
                                     "minimax_m3_nvfp4", None),
    }.get(runner)
    if allowed is not None and quant not in allowed:
        raise RejectedEarlier(AssertionError(f"Invalid quantization '{quant}'."))


def resolve_deepep_mode(runner: str, deepep_mode: str, *, w4a16: bool = False, profile: str = DEFAULT_PROFILE) -> str:
    """flashinfer_cutedsl with DeepEP: auto -> low_latency; normal -> ValueError (no CuTe DSL normal-dispatch
    handler; unrelated to W4A16, so :class:`RejectedEarlier`).
    MAIN: normal is accepted under W4A16 (the CuTe DSL wrapper serves DeepEP normal dispatch with rank-local
    expert ids and BF16 activations); without W4A16 it stays rejected (no upstream test says otherwise)."""
    check_profile(profile)
    if runner != "flashinfer_cutedsl":
        return deepep_mode
    if deepep_mode == "normal" and w4a16 and profile == "sglang-main":
        return "normal"
    if deepep_mode == "normal":
        raise RejectedEarlier(ValueError("flashinfer_cutedsl FP4 MoE only supports DeepEP low_latency dispatch"))
    return "low_latency"


def a2a_dispatch_dtype(
    *, env_w4a16: str, nvfp4_dispatch_env: str, dispatch_type: str, a2a: str, runner: str, quantization: str
) -> str | None:
    """The MoE A2A dispatch dtype the server resolves (``None`` when the A2A backend has no such notion),
    or the ValueError it raises (docs/contracts.md section 4)."""
    runner = resolve_moe_runner(runner, quantization)
    check_moe_kernel_config(runner, quantization)
    cli = None if dispatch_type == "none" else dispatch_type
    if a2a != "flashinfer":
        if cli not in (None, "auto"):
            raise ValueError("--flashinfer-a2a-dispatch-type requires --moe-a2a-backend flashinfer.")
        if a2a == "deepep":
            resolve_deepep_mode(runner, "auto")
        return None
    w4a16 = runner == "flashinfer_cutedsl" and env_true(env_w4a16)
    if w4a16 and env_true(nvfp4_dispatch_env):
        raise ValueError("CuTe DSL NVFP4 W4A16 requires BF16 FlashInfer MoE dispatch; unset SGLANG_MOE_NVFP4_DISPATCH.")
    supports_nvfp4 = quantization == "modelopt_fp4"
    if cli is None:
        # W4A16 never auto-enables NVFP4 dispatch; without it NVFP4 checkpoints do when the env is unset.
        if nvfp4_dispatch_env == "unset":
            return "nvfp4" if (not w4a16 and supports_nvfp4) else "bf16"
        return "nvfp4" if env_true(nvfp4_dispatch_env) else "bf16"
    if w4a16 and cli in ("auto", "nvfp4"):
        raise ValueError("CuTe DSL NVFP4 W4A16 requires --flashinfer-a2a-dispatch-type bf16.")
    if nvfp4_dispatch_env != "unset":
        raise ValueError("SGLANG_MOE_NVFP4_DISPATCH cannot be set together with --flashinfer-a2a-dispatch-type.")
    resolved = cli
    if resolved == "auto":
        resolved = "mxfp8" if quantization == "mxfp8" else ("nvfp4" if supports_nvfp4 else "bf16")
    if resolved == "mxfp8":
        if quantization != "mxfp8":
            raise ValueError("--flashinfer-a2a-dispatch-type mxfp8 requires --quantization mxfp8.")
        if runner not in ("flashinfer_trtllm_routed", "flashinfer_trtllm"):
            # CODE: flashinfer_trtllm is first rewritten to flashinfer_trtllm_routed under FlashInfer A2A.
            raise ValueError("--flashinfer-a2a-dispatch-type mxfp8 requires --moe-runner-backend flashinfer_trtllm_routed.")
    elif resolved == "nvfp4" and not supports_nvfp4:
        raise ValueError("--flashinfer-a2a-dispatch-type nvfp4 requires NVFP4/modelopt-FP4 quantization")
    return resolved


# ---- MoE layer --------------------------------------------------------------------------------------------

def moe_quant_mode(*, env_w4a16: str, runner: str, a2a: str, deepep_mode: str, profile: str = DEFAULT_PROFILE) -> str:
    """The NVFP4 MoE layer's mode. docs/contracts.md section 4: W4A16 iff the env flag is true AND the runner is flashinfer_cutedsl
    on its standard (v2) path (A2A none or flashinfer). DeepEP + flashinfer_cutedsl is the v1 masked path:
    W4A4 only, W4A16 there raises ValueError (CODE: at the layer's first forward).
    MAIN: DeepEP *normal* + flashinfer_cutedsl + W4A16 is accepted and runs W4A16."""
    w4a16 = env_true(env_w4a16)
    if a2a == "deepep":
        mode = resolve_deepep_mode(runner, deepep_mode, w4a16=w4a16, profile=profile)
        if runner == "flashinfer_cutedsl" and mode == "normal":
            return "w4a16"  # only reachable on sglang-main with W4A16
    if runner != "flashinfer_cutedsl":
        return "w4a4"
    if a2a == "deepep":
        if env_true(env_w4a16):
            raise ValueError("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16 does not support the CuTe DSL v1 DeepEP masked MoE path.")
        return "w4a4"
    return "w4a16" if env_true(env_w4a16) else "w4a4"


# ---- fusion guards ----------------------------------------------------------------------------------------

def fusion_enabled(*, model: str, gate_up_method: str, quant_mode: str | None, fp4_backend: str) -> bool:
    """Fused kernels that consume NVFP4 activations run only under ``w4a4`` (docs/contracts.md section 4).

    ``deepseek_v2``: shared-expert GEMM+SwiGLU fusion; also needs a backend that builds the fused SwiGLU
    layout (not marlin, not flashinfer_trtllm). Other preconditions (SM100, no LoRA, fc1 % 128 == 0, no
    swiglu limit, no piecewise prefill graph) are held true by the cases.
    ``qwen3_5``: SiLU+mul+FP4-quant fusion of the dense MLP (needs the FlashInfer kernel importable)."""
    quantized = gate_up_method == "ModelOptFp4LinearMethod" and quant_mode == "w4a4"
    if model == "deepseek_v2":
        return quantized and fp4_backend not in ("marlin", "flashinfer_trtllm")
    if model == "qwen3_5":
        return quantized
    raise ValueError(f"unknown model {model!r}")
