"""tiermoe.arch.code_form: a class has a reference's code when its method, and everything of its module the method
reaches, computes the same; names, docstrings and annotations aside. The fused paths key on it."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from tiermoe.arch.code_form import CodeForms, _method_alone, class_key, same_code

MODULE = '''
"""A module of one norm and its helpers."""
from math import sqrt

import torch

SCALE = 2.0


def helper(x):
    return inner(x) * SCALE


def inner(x):
    return sqrt(x.pow(2))


class {name}(torch.nn.Module):
    """{name}'s docstring."""

    offset = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """What it computes."""
        y: torch.Tensor = helper(x)
        return self.finish(y)

    def finish(self, y):
        return y + self.offset
'''


@pytest.fixture
def module_of(tmp_path):
    """module_of(name, source) -> the class `name` of `source` loaded as a module of its own (in sys.modules, as
    a modeling file is)."""
    loaded = []

    def make(name: str, source: str) -> type:
        module_name = f"code_form_case_{name.lower()}_{len(loaded)}"
        path = tmp_path / f"{module_name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        loaded.append(module_name)
        spec.loader.exec_module(module)
        return getattr(module, name)

    yield make
    for name in loaded:
        sys.modules.pop(name, None)


def test_the_same_code_under_other_names_docstrings_and_annotations_is_the_same(module_of):
    reference = module_of("RefNorm", MODULE.format(name="RefNorm"))
    renamed = module_of("OtherNorm", MODULE.format(name="OtherNorm").replace(
        "def forward(self, x: torch.Tensor) -> torch.Tensor:", "def forward(self, x):").replace(
        '"""What it computes."""', '"""Something else entirely."""'))
    assert same_code(renamed, reference) and same_code(reference, renamed)
    forms = CodeForms({class_key(reference): "ref"})
    assert forms.of(renamed) == "ref" and forms.of(reference) == "ref"
    assert forms.of(int) is None


@pytest.mark.parametrize("change", [
    ("return sqrt(x.pow(2))", "return sqrt(x.pow(3))"),  # a helper two calls away
    ("SCALE = 2.0", "SCALE = 2.5"),  # a constant a helper reads
    ("return y + self.offset", "return y + 2"),  # a method on self
    ("offset = 1", "offset = 2"),  # a class attribute a method on self reads
    ("from math import sqrt", "from cmath import sqrt"),  # another object under the name a helper reads
    ("y: torch.Tensor = helper(x)", "y = inner(x)"),  # the method itself
    ("\nclass OtherNorm", "\ndef keep(cls):\n    return cls\n\n\n@keep\nclass OtherNorm"),  # a class decorator
])
def test_a_change_anywhere_the_method_reaches_is_not_the_same_code(module_of, change):
    reference = module_of("RefNorm", MODULE.format(name="RefNorm"))
    changed = module_of("OtherNorm", MODULE.format(name="OtherNorm").replace(*change, 1))
    assert not same_code(changed, reference)
    assert CodeForms({class_key(reference): "ref"}).of(changed) is None


def test_a_subclass_is_the_same_code_unless_it_overrides_what_the_method_calls(module_of):
    source = MODULE.format(name="RefNorm") + textwrap.dedent('''

        class Overrides(RefNorm):
            def finish(self, y):
                return y + 5 * self.offset


        class Inherits(RefNorm):
            pass
        ''')
    overrides = module_of("Overrides", source)
    module = sys.modules[overrides.__module__]
    assert same_code(module.Inherits, module.RefNorm)
    assert not same_code(overrides, module.RefNorm)


def test_transformers_families_that_copy_a_fused_familys_attention_are_found_and_the_others_not():
    from transformers.models.dots1.modeling_dots1 import Dots1Attention
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
        Ernie4_5_MoeAttention,
    )
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeAttention
    from transformers.models.mellum.modeling_mellum import MellumAttention
    from transformers.models.olmoe.modeling_olmoe import OlmoeAttention
    from transformers.models.phimoe.modeling_phimoe import PhimoeAttention
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    assert same_code(MellumAttention, Qwen3MoeAttention) and same_code(Dots1Attention, Qwen3MoeAttention)
    assert same_code(PhimoeAttention, Qwen2MoeAttention) and same_code(GraniteMoeAttention, Qwen2MoeAttention)
    assert not same_code(OlmoeAttention, Qwen3MoeAttention)  # its norms span all heads, and it clips
    assert not same_code(MellumAttention, Qwen2MoeAttention)
    # Qwen3.5-MoE's RMSNorm names a hub kernel in a class decorator Qwen3-Next's lacks: inert unless kernelized
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    assert same_code(Qwen3_5MoeRMSNorm, Qwen3NextRMSNorm)
    # ERNIE 4.5's forward is Qwen2-MoE's line for line, but the apply_rotary_pos_emb it calls turns interleaved pairs
    assert _method_alone(Ernie4_5_MoeAttention, "forward") == _method_alone(Qwen2MoeAttention, "forward")
    assert not same_code(Ernie4_5_MoeAttention, Qwen2MoeAttention)
