"""The ATen ops `ops.enable()` routes, and under which of our names: plain data (no torch, no triton), so that
the driver's config checks `kernels.include`/`exclude` and `python -m ops list` prints the table without
loading the kernels. `ops.aten` builds the routing from it, each overload's function found by its name in
the module of its family (`ATEN` there).

`ROUTES`: family -> our op -> the ATen overloads it routes (its forward and backward, in-place and out= forms);
a name a user gives (`kernels.include`, `ops.enable(include)`) is ours (`softmax`: every overload of it) or
ATen's (`_softmax`: that one overload).
"""

from __future__ import annotations

ROUTES: dict[str, dict[str, tuple[str, ...]]] = {
    "activations": {
        "silu": ("silu", "silu_backward"), "gelu": ("gelu", "gelu_backward"),
    },
    "softmax": {
        "softmax": ("_softmax", "_softmax_backward_data"),
        "log_softmax": ("_log_softmax", "_log_softmax_backward_data"),
    },
    "blas": {
        "addmm": ("addmm", "addmm_"), "mm": ("mm", "mm.out"), "bmm": ("bmm",), "baddbmm": ("baddbmm",),
        "_grouped_mm": ("_grouped_mm",), "mv": ("mv",), "dot": ("dot",),
    },
    "embedding": {
        "embedding": ("embedding", "embedding_dense_backward"),
    },
    # Clipping: each gradient's norm, the norm of the norms, the scale applied.
    "clipping": {
        "foreach_norm": ("_foreach_norm.Scalar",), "stack": ("stack",), "vector_norm": ("linalg_vector_norm",),
        "foreach_mul_": ("_foreach_mul_.Tensor",),
    },
    "attention": {
        "_scaled_dot_product_flash_attention_for_cpu": ("_scaled_dot_product_flash_attention_for_cpu",
                                                        "_scaled_dot_product_flash_attention_for_cpu_backward"),
    },
    "pointwise": {
        "exp": ("exp", "exp_"), "exp2": ("exp2", "exp2_"), "expm1": ("expm1", "expm1_"), "log": ("log", "log_"),
        "log2": ("log2", "log2_"), "log10": ("log10", "log10_"), "log1p": ("log1p", "log1p_"),
        "sqrt": ("sqrt", "sqrt_"), "rsqrt": ("rsqrt", "rsqrt_"), "sin": ("sin", "sin_"), "cos": ("cos", "cos_"),
        "tan": ("tan", "tan_"), "sinh": ("sinh", "sinh_"), "cosh": ("cosh", "cosh_"),
        "tanh": ("tanh", "tanh_", "tanh_backward"), "asinh": ("asinh", "asinh_"), "acosh": ("acosh", "acosh_"),
        "atanh": ("atanh", "atanh_"), "sigmoid": ("sigmoid", "sigmoid_", "sigmoid_backward"), "erf": ("erf", "erf_"),
        "erfc": ("erfc", "erfc_"), "reciprocal": ("reciprocal", "reciprocal_"), "deg2rad": ("deg2rad", "deg2rad_"),
        "rad2deg": ("rad2deg", "rad2deg_"), "sinc": ("sinc", "sinc_"), "abs": ("abs", "abs_"), "neg": ("neg", "neg_"),
        "sign": ("sign", "sign_"), "floor": ("floor", "floor_"), "ceil": ("ceil", "ceil_"),
        "trunc": ("trunc", "trunc_"), "round": ("round", "round_"), "frac": ("frac", "frac_"),
        "relu": ("relu", "relu_"), "bitwise_not": ("bitwise_not", "bitwise_not_"),
        "logical_not": ("logical_not", "logical_not_"), "isnan": ("isnan",), "isinf": ("isinf",),
        "isposinf": ("isposinf",), "isneginf": ("isneginf",), "signbit": ("signbit",),
        "hardsigmoid": ("hardsigmoid", "hardsigmoid_", "hardsigmoid_backward"),
        "hardswish": ("hardswish", "hardswish_", "hardswish_backward"), "mish": ("mish", "mish_"),
        "sgn": ("sgn", "sgn_"), "add": ("add.Tensor", "add.Scalar", "add_.Tensor", "add_.Scalar"),
        "sub": ("sub.Tensor", "sub.Scalar", "sub_.Tensor", "sub_.Scalar"), "rsub": ("rsub.Tensor", "rsub.Scalar"),
        "mul": ("mul.Tensor", "mul_.Tensor", "mul.Scalar", "mul_.Scalar"),
        "div": ("div.Tensor", "div_.Tensor", "div.Scalar", "div_.Scalar", "div.Tensor_mode", "div.Scalar_mode",
                "div_.Tensor_mode"),
        "remainder": ("remainder.Tensor", "remainder_.Tensor", "remainder.Scalar", "remainder_.Scalar"),
        "fmod": ("fmod.Tensor", "fmod_.Tensor", "fmod.Scalar", "fmod_.Scalar"),
        "bitwise_and": ("bitwise_and.Tensor", "bitwise_and_.Tensor", "bitwise_and.Scalar", "bitwise_and_.Scalar"),
        "bitwise_or": ("bitwise_or.Tensor", "bitwise_or_.Tensor", "bitwise_or.Scalar", "bitwise_or_.Scalar"),
        "bitwise_xor": ("bitwise_xor.Tensor", "bitwise_xor_.Tensor", "bitwise_xor.Scalar", "bitwise_xor_.Scalar"),
        "eq": ("eq.Tensor", "eq_.Tensor", "eq.Scalar", "eq_.Scalar"),
        "ne": ("ne.Tensor", "ne_.Tensor", "ne.Scalar", "ne_.Scalar"),
        "lt": ("lt.Tensor", "lt_.Tensor", "lt.Scalar", "lt_.Scalar"),
        "le": ("le.Tensor", "le_.Tensor", "le.Scalar", "le_.Scalar"),
        "gt": ("gt.Tensor", "gt_.Tensor", "gt.Scalar", "gt_.Scalar"),
        "ge": ("ge.Tensor", "ge_.Tensor", "ge.Scalar", "ge_.Scalar"),
        "floor_divide": ("floor_divide", "floor_divide.Scalar", "floor_divide_.Tensor"), "maximum": ("maximum",),
        "minimum": ("minimum",), "fmax": ("fmax",), "fmin": ("fmin",), "hypot": ("hypot", "hypot_"),
        "logaddexp": ("logaddexp",), "logaddexp2": ("logaddexp2",), "heaviside": ("heaviside", "heaviside_"),
        "logical_and": ("logical_and", "logical_and_"), "logical_or": ("logical_or", "logical_or_"),
        "logical_xor": ("logical_xor", "logical_xor_"),
        "copysign": ("copysign.Tensor", "copysign.Scalar", "copysign_.Tensor"),
        "xlogy": ("xlogy_.Tensor", "xlogy.Tensor", "xlogy.Scalar_Other"),
        "bitwise_left_shift": ("bitwise_left_shift.Tensor",), "bitwise_right_shift": ("bitwise_right_shift.Tensor",),
        "pow": ("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar", "pow_.Scalar", "pow_.Tensor"),
        "lerp": ("lerp.Scalar", "lerp.Tensor", "lerp_.Scalar", "lerp_.Tensor"), "addcmul": ("addcmul", "addcmul_"),
        "addcdiv": ("addcdiv", "addcdiv_"), "where": ("where.self",),
        "masked_fill": ("masked_fill.Scalar", "masked_fill.Tensor", "masked_fill_.Scalar", "masked_fill_.Tensor"),
        "clamp": ("clamp", "clamp.Tensor", "clamp_"), "clamp_min": ("clamp_min", "clamp_min.Tensor", "clamp_min_"),
        "clamp_max": ("clamp_max", "clamp_max.Tensor", "clamp_max_"), "nan_to_num": ("nan_to_num", "nan_to_num_"),
        "fill": ("fill.Scalar", "fill_.Scalar", "fill_.Tensor"), "zero_": ("zero_",),
        "hardtanh": ("hardtanh", "hardtanh_", "hardtanh_backward"),
        "leaky_relu": ("leaky_relu", "leaky_relu_", "leaky_relu_backward"), "elu": ("elu", "elu_", "elu_backward"),
        "softplus": ("softplus", "softplus_backward"), "log_sigmoid": ("log_sigmoid_forward", "log_sigmoid_backward"),
        "threshold": ("threshold", "threshold_", "threshold_backward"), "logit": ("logit", "logit_", "logit_backward"),
    },
    "copies": {
        "copy_": ("copy_",), "_to_copy": ("_to_copy",), "clone": ("clone",),
    },
    "reductions": {
        "sum": ("sum", "sum.dim_IntList"), "mean": ("mean", "mean.dim"), "prod": ("prod", "prod.dim_int"),
        "amax": ("amax",), "amin": ("amin",), "max": ("max", "max.dim"), "min": ("min", "min.dim"),
        "argmax": ("argmax",), "argmin": ("argmin",), "var": ("var.correction",), "std": ("std.correction",),
        "var_mean": ("var_mean.correction",), "std_mean": ("std_mean.correction",),
        "all": ("all", "all.dim", "all.dims"), "any": ("any", "any.dim", "any.dims"), "logsumexp": ("logsumexp",),
        "norm": ("norm.Scalar", "norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype"), "nansum": ("nansum",),
        "count_nonzero": ("count_nonzero", "count_nonzero.dim_IntList"), "aminmax": ("aminmax",),
    },
    "scans": {
        "cumsum": ("cumsum", "cumsum_"), "cumprod": ("cumprod", "cumprod_"), "cummax": ("cummax",),
        "cummin": ("cummin",),
    },
    "sorting": {
        "sort": ("sort", "sort.stable"), "topk": ("topk",),
    },
    "norms": {
        "native_layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
        "_fused_rms_norm": ("_fused_rms_norm", "_fused_rms_norm_backward"),
        "native_group_norm": ("native_group_norm", "native_group_norm_backward"),
    },
    "indexing": {
        "index_select": ("index_select",), "gather": ("gather",),
        "scatter": ("scatter.src", "scatter.value", "scatter_.value", "scatter_.src"),
        "scatter_add": ("scatter_add", "scatter_add_"), "index_add": ("index_add", "index_add_"),
        "index_copy": ("index_copy",), "index_put": ("index_put", "index_put_"), "masked_select": ("masked_select",),
        "nonzero": ("nonzero",), "cat": ("cat",), "flip": ("flip",), "repeat": ("repeat",), "tril": ("tril", "tril_"),
        "triu": ("triu", "triu_"), "arange": ("arange.start_step", "arange.start", "arange"), "full": ("full",),
        "zeros": ("zeros",), "ones": ("ones",), "uniform_": ("uniform_",), "normal_": ("normal_",),
        "multinomial": ("multinomial",), "exponential_": ("exponential_",), "index": ("index.Tensor",),
        "isin": ("isin.Tensor_Tensor",),
        "masked_scatter": ("masked_scatter", "masked_scatter_", "masked_scatter_backward"),
        "bernoulli_": ("bernoulli_.float",), "dropout": ("native_dropout", "native_dropout_backward"),
        "slice_backward": ("slice_backward",), "histc": ("histc",), "repeat_interleave": ("repeat_interleave.Tensor",),
        "unique_consecutive": ("unique_consecutive",), "select_backward": ("select_backward",),
        "mse_loss": ("mse_loss", "mse_loss_backward"), "nll_loss": ("nll_loss_forward", "nll_loss_backward"),
    },
    "foreach": {
        "_foreach_add": ("_foreach_add.Scalar", "_foreach_add.List", "_foreach_add.ScalarList", "_foreach_add.Tensor",
                         "_foreach_add_.Scalar", "_foreach_add_.List", "_foreach_add_.ScalarList",
                         "_foreach_add_.Tensor"),
        "_foreach_sub": ("_foreach_sub.Scalar", "_foreach_sub.List", "_foreach_sub.ScalarList", "_foreach_sub_.Scalar",
                         "_foreach_sub_.List", "_foreach_sub_.ScalarList"),
        "_foreach_mul": ("_foreach_mul.Scalar", "_foreach_mul.List", "_foreach_mul.ScalarList", "_foreach_mul.Tensor",
                         "_foreach_mul_.Scalar", "_foreach_mul_.List", "_foreach_mul_.ScalarList"),
        "_foreach_div": ("_foreach_div.Scalar", "_foreach_div.List", "_foreach_div.ScalarList", "_foreach_div.Tensor",
                         "_foreach_div_.Scalar", "_foreach_div_.List", "_foreach_div_.ScalarList",
                         "_foreach_div_.Tensor"),
        "_foreach_maximum": ("_foreach_maximum.Scalar", "_foreach_maximum.List", "_foreach_maximum.ScalarList",
                             "_foreach_maximum_.Scalar", "_foreach_maximum_.List", "_foreach_maximum_.ScalarList"),
        "_foreach_minimum": ("_foreach_minimum.Scalar", "_foreach_minimum.List", "_foreach_minimum.ScalarList",
                             "_foreach_minimum_.Scalar", "_foreach_minimum_.List", "_foreach_minimum_.ScalarList"),
        "_foreach_pow": ("_foreach_pow.Scalar", "_foreach_pow.List", "_foreach_pow.ScalarList", "_foreach_pow_.Scalar",
                         "_foreach_pow_.List", "_foreach_pow_.ScalarList"),
        "_foreach_sqrt": ("_foreach_sqrt", "_foreach_sqrt_"), "_foreach_exp": ("_foreach_exp", "_foreach_exp_"),
        "_foreach_log": ("_foreach_log", "_foreach_log_"), "_foreach_abs": ("_foreach_abs", "_foreach_abs_"),
        "_foreach_neg": ("_foreach_neg", "_foreach_neg_"), "_foreach_sign": ("_foreach_sign", "_foreach_sign_"),
        "_foreach_reciprocal": ("_foreach_reciprocal", "_foreach_reciprocal_"),
        "_foreach_sigmoid": ("_foreach_sigmoid", "_foreach_sigmoid_"),
        "_foreach_tanh": ("_foreach_tanh", "_foreach_tanh_"), "_foreach_rsqrt": ("_foreach_rsqrt", "_foreach_rsqrt_"),
        "_foreach_sin": ("_foreach_sin", "_foreach_sin_"), "_foreach_cos": ("_foreach_cos", "_foreach_cos_"),
        "_foreach_addcmul": ("_foreach_addcmul.Scalar", "_foreach_addcmul.ScalarList", "_foreach_addcmul.Tensor",
                             "_foreach_addcmul_.Scalar", "_foreach_addcmul_.ScalarList", "_foreach_addcmul_.Tensor"),
        "_foreach_addcdiv": ("_foreach_addcdiv.Scalar", "_foreach_addcdiv.ScalarList", "_foreach_addcdiv.Tensor",
                             "_foreach_addcdiv_.Scalar", "_foreach_addcdiv_.ScalarList", "_foreach_addcdiv_.Tensor"),
        "_foreach_lerp": ("_foreach_lerp.Scalar", "_foreach_lerp_.Scalar", "_foreach_lerp.List", "_foreach_lerp_.List"),
        "_foreach_zero_": ("_foreach_zero_",), "_foreach_copy_": ("_foreach_copy_",),
    },
}
# (our op, the ATen overload it routes), in the order they are registered.
TABLE = tuple((ours, aten) for family in ROUTES.values() for ours, atens in family.items() for aten in atens)
# Our names, each with its overloads (what `ops.enable()` takes), and ATen's, one overload each.
ATEN_OPS = tuple(sorted({ours for ours, _ in TABLE}))
NAMES: dict[str, tuple[str, ...]] = {**{aten: (aten,) for _, aten in TABLE},
                                     **{ours: tuple(a for o, a in TABLE if o == ours) for ours in ATEN_OPS}}
