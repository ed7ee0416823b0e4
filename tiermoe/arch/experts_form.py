"""How a fused experts module computes, read from the module built on the meta device (tiermoe.arch.discover).

transformers' experts interface (`@use_experts_implementation`) records the layout on the class: gated or not,
biases, transposed, gate and up interleaved; its `_apply_gate` and `act_fn` compute the activation, which is one a
native kernel has where it is exactly SiLU-GLU or GPT-OSS's clamped SwiGLU (checked on numbers), else the module's
own. Two modules outside the interface are read too (tiermoe.arch.spec.EXPERTS_CALLS): one whose own forward works
around the interface's call (Ergo: a learned norm per expert on each route's output), and one called with every
expert's copy of every token, scaled by the router (Llama-4), whose arithmetic is checked on numbers.
Legend: E experts, H hidden, I expert intermediate size. transformers' interface and activations are imported by
the functions that read a module (transformers.integrations.moe imports transformers' model loading, seconds, and
tiermoe.arch is imported by commands that never build a model).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from tiermoe.errors import TiermoeError

FUSED_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertsForm:
    """One layer's fused experts module, as its class and decorator describe it."""

    cls: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    gated: bool  # gate_up_proj (gate and up) rather than up_proj alone
    bias: bool
    transposed: bool  # x @ W layout: [E, H, 2I] / [E, I, H]
    interleaved: bool  # gate and up columns alternate
    activation: str  # tiermoe.arch.spec.ACTIVATIONS
    act_name: str  # what computes the activation, for people: "SiLUActivation", "GptOssExperts._apply_gate"
    call: str = "interface"  # tiermoe.arch.spec.EXPERTS_CALLS


def fused_weight(experts: nn.Module) -> torch.Tensor | None:
    """The experts' first fused matrix: gate_up_proj (or up_proj for experts without a gate), 3-D."""
    for name in ("gate_up_proj", "up_proj"):
        weight = experts._parameters.get(name)
        if weight is not None and weight.dim() == 3:
            return weight
    return None


def experts_form(experts: nn.Module, model_type: str = "") -> ExpertsForm:
    """How a fused experts module computes (its decorator's flags, shapes, gating) and how its block calls it."""
    cls = type(experts)
    if not hasattr(experts, "has_gate"):
        return _every_expert_form(experts, model_type)
    if getattr(experts, "has_post_expert_norm", False):
        raise TiermoeError(f"{model_type}: its experts ({cls.__name__}) normalise each expert's output inside "
                           "transformers' experts interface, which tiermoe's tiers do not compute yet")
    interface = interface_class(cls)
    call = "interface" if interface is cls else "around"
    extra = [n for n, _ in experts.named_parameters() if n not in FUSED_NAMES]
    if interface is None or (call == "interface" and extra):
        held = f"per-expert state {', '.join(extra)}" if extra else "its own forward"
        raise TiermoeError(f"{model_type}: its experts module {cls.__name__} computes more than transformers' experts "
                           f"interface ({held}), which tiermoe's tiers do not hold yet")
    if call == "around":
        _check_around(cls, model_type)
    gated, transposed = bool(experts.has_gate), bool(experts.is_transposed)
    first, down = fused_weight(experts), experts.down_proj
    e = first.shape[0]
    h, i = (down.shape[2], down.shape[1]) if transposed else (down.shape[1], down.shape[2])
    bias = bool(experts.has_bias)
    activation, act_name = _activation(experts, gated, bias)
    return ExpertsForm(cls.__name__, e, h, i, gated, bias, transposed, not experts.is_concatenated, activation,
                       act_name, call)


def interface_class(cls: type) -> type | None:
    """The class of `cls`'s MRO whose forward is transformers' experts interface (the decorator's, which keeps the
    class's own as `__wrapped__`): `cls` itself, a base whose call `cls`'s own forward works around, or None."""
    for klass in cls.__mro__:
        if getattr(klass.__dict__.get("forward"), "__code__", None) is _interface_forward():
            return klass
    return None


@functools.cache
def _interface_forward():
    """The code of the forward transformers' decorator gives every experts class (the same for all of them)."""
    from transformers.integrations.moe import use_experts_implementation

    return use_experts_implementation(type("Probe", (nn.Module,), {"forward": lambda self: None})).forward.__code__


# An own forward around the interface must reach the fused weights only through the interface's call: the tiers
# hold them, and the module keeps only its other state (Ergo's per-expert norm).
_FUSED_ATTRIBUTE = re.compile(r"self\.(gate_up_proj|up_proj|down_proj)\b")


def _check_around(cls: type, model_type: str) -> None:
    own = [klass for klass in cls.__mro__ if klass is not interface_class(cls) and "forward" in klass.__dict__
           and issubclass(klass, interface_class(cls))]
    for klass in own:
        try:
            source = inspect.getsource(klass.__dict__["forward"])
        except (OSError, TypeError):
            source = "self.down_proj"  # unreadable: assume the worst
        if _FUSED_ATTRIBUTE.search(source):
            raise TiermoeError(f"{model_type}: its experts module {cls.__name__} reads its fused weights in its own "
                               f"forward ({klass.__name__}.forward), which tiermoe's tiers do not hold yet")


def _every_expert_form(experts: nn.Module, model_type: str) -> ExpertsForm:
    """An experts module called as `experts(x [E * T, H])`, every expert's copy of every token (Llama-4's: the block
    scales each copy by its routing weight, 0 where the router did not pick the expert): accepted where its own
    forward, on numbers, is `down_e(act(gate_e x) * up_e x)` on E blocks of rows with `[gate | up]` fused, no
    biases (so a row scaled to 0 gives 0, and only the picked rows need computing)."""
    cls = type(experts).__name__
    params = list(inspect.signature(type(experts).forward).parameters)
    first, down = experts._parameters.get("gate_up_proj"), experts._parameters.get("down_proj")
    others = [n for n, _ in experts.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    if params != ["self", "hidden_states"] or first is None or down is None or first.dim() != 3 or others:
        raise TiermoeError(f"{model_type}: its experts module {cls} does not take the experts interface "
                           "(hidden, top-k ids, top-k weights), so tiermoe cannot split it across two tiers")
    e = first.shape[0]
    transposed = first.shape[1] == down.shape[2] and first.shape[2] == 2 * down.shape[1]  # [E, H, 2I], [E, I, H]
    h, i = (down.shape[2], down.shape[1]) if transposed else (down.shape[1], down.shape[2])
    act = getattr(experts, "act_fn", None)
    if not _every_expert_checks(experts, transposed, h, i):
        raise TiermoeError(f"{model_type}: its experts module {cls} computes something other than a gated expert "
                           "per block of rows (checked on numbers), so tiermoe cannot split it across two tiers")
    kernel = isinstance(act, _silu_classes())
    return ExpertsForm(cls, e, h, i, True, False, transposed, False, "silu_glu" if kernel else "model",
                       type(act).__name__, "every_expert")


def _every_expert_checks(experts: nn.Module, transposed: bool, h: int, i: int) -> bool:
    """Whether the module's own forward, on a copy of it with 3 experts of tiny random weights (its size attributes
    set to match), is the gated expert `_every_expert_form` reads."""
    small_h, small_i, e = 8, 4, 3
    sizes = {h: small_h, i: small_i} if h != i else {h: small_h}
    twin = object.__new__(type(experts))
    twin.__dict__.update({k: (sizes.get(v, v) if isinstance(v, int) and not isinstance(v, bool) else v)
                          for k, v in experts.__dict__.items()})
    twin._parameters, twin._buffers = {}, {}
    g = torch.Generator().manual_seed(0)
    small_i = sizes.get(i, small_h)
    gate_up = torch.randn(e, 2 * small_i, small_h, generator=g)  # [E, 2I, H]
    down_w = torch.randn(e, small_h, small_i, generator=g)  # [E, H, I]
    twin.gate_up_proj = nn.Parameter(gate_up.transpose(1, 2).contiguous() if transposed else gate_up)
    twin.down_proj = nn.Parameter(down_w.transpose(1, 2).contiguous() if transposed else down_w)
    twin.num_experts = e
    x = torch.randn(e * 5, small_h, generator=g)
    try:
        with torch.no_grad():
            got = type(experts).forward(twin, x)
    except (RuntimeError, TypeError, AttributeError, ValueError, IndexError):
        return False
    act = getattr(experts, "act_fn", None)
    if act is None:
        return False
    want = []
    for k, rows in enumerate(x.view(e, 5, small_h)):
        gate, up = (rows @ gate_up[k].T).chunk(2, dim=-1)
        want.append((act(gate) * up) @ down_w[k].T)
    return got.shape == (e * 5, small_h) and torch.allclose(got, torch.cat(want), rtol=1e-5, atol=1e-5)


def _silu_classes() -> tuple[type, ...]:
    """The modules that compute SiLU: transformers' and torch's."""
    from transformers.activations import SiLUActivation

    return SiLUActivation, nn.SiLU


def _activation(experts: nn.Module, gated: bool, bias: bool) -> tuple[str, str]:
    """The activation kind: one a native kernel computes where the module's own gating is exactly it, else the
    module's own ("model")."""
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(experts, "act_fn", None)
    cls = type(experts)
    if not gated:
        return "model", type(act).__name__
    if getattr(cls, "_apply_gate", None) is _default_apply_gate:
        kernel = isinstance(act, _silu_classes()) and not bias and experts.is_concatenated
        return ("silu_glu" if kernel else "model"), type(act).__name__
    if _is_gpt_oss_glu(experts):
        return "gpt_oss_glu", f"{cls.__name__}._apply_gate"
    return "model", f"{cls.__name__}._apply_gate"


def _is_gpt_oss_glu(experts: nn.Module) -> bool:
    """Whether the module's own `_apply_gate` is GPT-OSS's clamped GLU with its `alpha` and `limit`: checked on
    numbers (a CPU tensor through the module's own method), not by name."""
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, float) or not isinstance(limit, float) or experts.is_concatenated:
        return False
    x = torch.linspace(-3 * limit, 3 * limit, 64, dtype=torch.float32).reshape(4, 16)
    try:
        got = type(experts)._apply_gate(experts, x)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return got.shape == gate.shape and torch.equal(got, (up + 1) * (gate * torch.sigmoid(gate * alpha)))
