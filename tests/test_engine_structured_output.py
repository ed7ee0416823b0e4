"""tiermoe.engine.structured_output: grammars compiled for the bundled demo tokenizer (byte-level BPE, 6144 ids),
decoded token by token under seeded random logits (the argmax of the masked logits: every step picks an arbitrary
allowed token, the harshest test of the mask), until the grammar is finished; the text must then parse and match.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from tiermoe.bundled import resolve_model
from tiermoe.engine import structured_output
from tiermoe.engine.structured_output import GrammarCompiler, GrammarState, apply_masks
from tiermoe.errors import TiermoeError

EOS = (2, 0)  # the demo's generation_config: <|im_end|>, <|endoftext|>

# Nested objects, arrays of enums and of objects, required and optional fields, a nullable field. Free strings
# and arrays are bounded so random tokens end them within a few dozen steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["active", "suspended", "closed"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churn"]}, "minItems": 1, "maxItems": 3},
        "orders": {
            "type": "array",
            "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                       "paid": {"type": "boolean"}},
                      "required": ["id", "paid"], "additionalProperties": False},
            "maxItems": 2,
        },
        "note": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["name", "status", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    pytest.importorskip("llguidance", reason="the structured extra: pip install 'tiermoe[structured]'")
    return GrammarCompiler(tokenizer, len(tokenizer), EOS)


def generate(state: GrammarState, width: int, seed: int, max_steps: int = 400,
             bias: torch.Tensor | None = None) -> list[int]:
    """Token ids until the grammar is finished (an EOS the grammar allowed ends it too, and is not returned)."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_steps):
        logits = torch.randn(width, generator=gen)
        logits = state.apply(logits if bias is None else logits + bias)
        token = int(torch.argmax(logits))
        assert torch.isfinite(logits[token]), "the mask left no token allowed"
        assert state.accept(token)
        if token in EOS:
            break
        ids.append(token)
        if state.finished:
            break
    assert state.finished, f"not finished after {max_steps} steps"
    return ids


def validate(value, schema: dict, path: str = "$") -> None:
    """The JSON-schema keywords SCHEMA uses, checked (jsonschema is not a dependency)."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
                  "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
                  "null": lambda v: v is None, "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert any(checks[t](value) for t in types), f"{path}: {value!r} is not {types}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, str) and "maxLength" in schema:
        assert len(value) <= schema["maxLength"], f"{path}: longer than {schema['maxLength']}"
    if isinstance(value, int) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        missing = set(schema.get("required", ())) - value.keys()
        assert not missing, f"{path}: required {sorted(missing)} missing"
        if schema.get("additionalProperties") is False:
            assert value.keys() <= properties.keys(), f"{path}: extra keys {sorted(value.keys() - properties.keys())}"
        for key, item in value.items():
            validate(item, properties.get(key, {}), f"{path}.{key}")
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{path}: item count"
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_replies_parse_and_match_the_schema(compiler, tokenizer, seed):
    state = compiler.compile("json_schema", SCHEMA).new_state()
    text = tokenizer.decode(generate(state, len(tokenizer), seed))
    validate(json.loads(text), SCHEMA)
    assert state.error is None


def test_a_schema_sent_as_json_text_is_the_same_grammar(compiler):
    assert compiler.compile("json_schema", json.dumps(SCHEMA)) is compiler.compile("json_schema", SCHEMA)


def test_the_true_schema_admits_any_json_value(compiler, tokenizer):
    state = compiler.compile("json_schema", "true").new_state()
    for token in tokenizer.encode("[1, null]", add_special_tokens=False):
        assert state.accept(token)
    assert state.accepting


def test_json_object_gives_a_json_object(compiler, tokenizer):
    # keys, strings and numbers are unbounded: a bias toward the tokens that end them keeps random decoding short
    closing = [i for i in range(len(tokenizer)) if re.fullmatch(r'\s*["}\]]+,?\s*', tokenizer.decode([i]))]
    bias = torch.zeros(len(tokenizer)).index_fill_(0, torch.tensor(closing), 4.0)
    for seed in range(3):
        state = compiler.compile("json_object").new_state()
        text = tokenizer.decode(generate(state, len(tokenizer), seed, bias=bias))
        assert isinstance(json.loads(text), dict)


def test_regex_replies_match_the_whole_regex(compiler, tokenizer):
    pattern = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}( ext\. [0-9]{1,4})?"
    for seed in range(3):
        text = tokenizer.decode(generate(compiler.compile("regex", pattern).new_state(), len(tokenizer), seed))
        assert re.fullmatch(pattern, text, re.ASCII), text  # \d is [0-9], not any Unicode digit


def test_ebnf_replies_are_in_the_language(compiler, tokenizer):
    gbnf = ('root ::= "move " piece " to " square ("+" | "#")?\n'
            'piece ::= "king" | "queen" | "rook" | "pawn"\n'
            'square ::= [a-h] [1-8]')
    for seed in range(3):
        text = tokenizer.decode(generate(compiler.compile("ebnf", gbnf).new_state(), len(tokenizer), seed))
        assert re.fullmatch(r"move (king|queen|rook|pawn) to [a-h][1-8][+#]?", text), text


@pytest.mark.parametrize(("kind", "source", "named"), [
    ("json_schema", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '"uniqueItems"'),
    ("json_schema", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if", "then"'),
    ("json_schema", {"type": "string", "pattern": "^(?!admin)"}, "look-around"),
    ("json_schema", {"type": "string", "format": "no-such-format"}, "Unknown format: no-such-format"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "false", "the schema false admits no reply"),
    ("json_schema", "[1]", "must be a JSON object (or true/false)"),
    ("regex", "(unclosed", "unclosed group"),
    ("regex", "ab\\", "trailing backslash"),
    ("ebnf", 'root ::= "a" missing', "missing"),
    ("xml", "<a/>", "grammar kind must be one of"),
])
def test_an_unsupported_or_broken_grammar_is_a_one_line_error_naming_it(compiler, kind, source, named):
    with pytest.raises(TiermoeError) as err:
        compiler.compile(kind, source)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_eos_is_allowed_only_once_the_grammar_is_complete(compiler, tokenizer):
    """A reply cut short (max_tokens) cannot have ended on EOS first: the engine reports `length`."""
    state = compiler.compile("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]}).new_state()
    for token in tokenizer.encode('{"a": 12', add_special_tokens=False):
        assert state.accept(token)
    allowed = state.allowed_mask(torch.zeros(len(tokenizer)))
    assert not allowed[list(EOS)].any() and not state.finished and not state.accepting
    assert state.accept(tokenizer.encode("}", add_special_tokens=False)[0])
    allowed = state.allowed_mask(torch.zeros(len(tokenizer)))
    assert state.finished and allowed.nonzero().flatten().tolist() == sorted(EOS)


def test_accept_refuses_a_disallowed_token_and_keeps_its_place(compiler, tokenizer):
    state = compiler.compile("regex", r"[0-9]+").new_state()
    assert not state.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert state.num_accepted == 0 and state.error is None
    assert state.accept(tokenizer.encode("7", add_special_tokens=False)[0]) and state.accepting
    state.rollback(1)
    assert state.num_accepted == 0 and not state.accepting


def test_unconstrained_rows_of_a_batch_are_untouched(compiler):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, compiler.vocab_size, generator=gen)
    before = logits.clone()
    grammar = compiler.compile("json_schema", SCHEMA)
    states = [None, grammar.new_state(), None, grammar.new_state()]
    assert apply_masks(logits, states) is logits
    for row in (0, 2):
        assert torch.equal(logits[row], before[row])
    for row in (1, 3):
        allowed = states[row].allowed_mask(logits[row])
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all() and 0 < allowed.sum() < compiler.vocab_size
    assert apply_masks(logits, [None] * 4) is logits and torch.equal(logits[0], before[0])


def test_logits_wider_than_the_tokenizer_never_allow_the_padding_ids(tokenizer):
    pytest.importorskip("llguidance")
    wide = GrammarCompiler(tokenizer, len(tokenizer) + 64, EOS)
    state = wide.compile("json_object").new_state()
    logits = state.apply(torch.zeros(len(tokenizer) + 64, dtype=torch.bfloat16))
    assert logits.dtype == torch.bfloat16 and torch.isneginf(logits[len(tokenizer):]).all()
    assert torch.isfinite(logits).sum() >= 1


def test_grammars_are_cached(compiler):
    assert compiler.compile("regex", "a+") is compiler.compile("regex", "a+")
    first, second = compiler.compile("regex", "a+").new_state(), compiler.compile("regex", "a+").new_state()
    assert first.accept(compiler.eos_token_ids[0]) is False and first.matcher is not second.matcher


def test_without_the_library_a_grammar_is_an_error_naming_the_extra(tokenizer, monkeypatch):
    monkeypatch.setattr(structured_output, "llguidance", None)
    with pytest.raises(TiermoeError, match=re.escape("pip install 'tiermoe[structured]'")):
        GrammarCompiler(tokenizer, len(tokenizer), EOS)
