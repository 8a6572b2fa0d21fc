# Activations the kernels apply in their epilogues (float32 in, float32 out).

from std.math import exp


@always_inline
def gelu_tanh(x: Float32) -> Float32:
    """GELU, tanh approximation (Gemma's hidden_activation gelu_pytorch_tanh).

    tanh(z) = 1 - 2 / (exp(2z) + 1): std.math.tanh lowers to tanh.approx.f32
    on NVIDIA (relative error ~2^-11); exp is accurate to a few ulp, and the
    formula saturates correctly (exp -> inf gives 1, exp -> 0 gives -1)."""
    comptime c = Float32(0.7978845608028654)  # sqrt(2 / pi)
    var z = c * (x + Float32(0.044715) * x * x * x)
    var th = Float32(1.0) - Float32(2.0) / (exp(Float32(2.0) * z) + Float32(1.0))
    return Float32(0.5) * x * (Float32(1.0) + th)
