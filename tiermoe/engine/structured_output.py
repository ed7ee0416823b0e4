"""Structured output: decoding held to a JSON schema, any JSON object, a regex or an EBNF grammar, by masking the
logits of each step to the tokens the grammar allows next.

Kinds (`GRAMMAR_KINDS`): "json_object" (OpenAI's response_format json_object: any JSON object; the source is
ignored), "json_schema" (a JSON schema, as a dict, a bool or its JSON text), "regex" (the whole reply matches it:
SGLang's `regex`; `\\d` and `\\w` are ASCII, `[0-9]` and `[0-9a-zA-Z_]`, as in JSON-schema patterns and xgrammar),
"ebnf" (SGLang's `ebnf`: GBNF / xgrammar's `root ::= ...` notation, or a Lark grammar).

The grammar library is llguidance (github.com/microsoft/llguidance, MIT; a grammar backend of vLLM and SGLang).
Against xgrammar, the other maintained choice (both were installed and tried, on CPU, with the bundled demo
tokenizer and Qwen's byte-level BPE):
- it refuses the JSON-schema keywords it cannot enforce and names them ('Unimplemented keys: ["uniqueItems"]'),
  and refuses look-around in `pattern`; xgrammar 0.2.9 compiles `if`/`then`, `not`, `uniqueItems` and
  look-ahead patterns by ignoring them, so a reply could break the very schema the client sent, with no 400;
- it has no Python dependencies (xgrammar's wheel requires torch, transformers, triton and apache-tvm-ffi, the last
  two of which a CPU install does not otherwise need) and imports in milliseconds (xgrammar: 1.7 s);
- masks come from an Earley parser over a token trie in Rust, computed per step on the CPU (on Qwen's 152k
  vocabulary: ~30 us for a typical JSON step, ~1.5 ms for the worst, inside a string with maxLength); a schema
  compiles in milliseconds, with no per-grammar table over the whole vocabulary; the tokenizer description is
  built once from a transformers fast tokenizer (byte-level BPE included: 30 ms for the demo's 6k vocabulary,
  2 s for Qwen's 152k), once per model (tiermoe.engine.llm.LLM.compile_grammar makes it on first use).

An optional extra, not a core dependency: `pip install 'tiermoe[structured]'`. llguidance's current wheels need
glibc >= 2.31 (manylinux_2_31; there is no manylinux2014 build of 1.9), so as a core dependency it would make a
plain `pip install tiermoe` fall back to a Rust source build on older distributions (RHEL 8, Amazon Linux 2), for
a feature unconstrained serving never uses. Without it, asking for a grammar raises a TiermoeError (a 400) that
names the pip command; everything else runs as before.

Use (one compiler per tokenizer; one state per sequence):

    compiler = GrammarCompiler(tokenizer, vocab_size=logits_width, eos_token_ids=stop_ids)
    grammar = compiler.compile("json_schema", schema)    # TiermoeError naming the problem: a 400
    state = grammar.new_state()
    ...each step: apply_masks(logits_BV, [state or None per row])  (or state.apply(logits_V) for one row),
    sample, then state.accept(token); state.finished -> stop ("stop"); max_tokens first -> "length" as ever.
    apply works in place: logprobs (the model's own distribution) are read before it; a sampled token the engine
    drops again (a failed stop check) is undone with state.rollback(1).

JSON is generated in json.dumps' layout (", " and ": ", no other whitespace): a small model free to choose its
whitespace can emit newlines until max_tokens. A schema's "x-guidance" object may override that (llguidance's
JSON options).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy

import numpy
import torch

from tiermoe.errors import TiermoeError

try:  # the optional extra; a missing library is reported when a grammar is asked for, not at import
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
except ImportError:
    llguidance = None

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
MISSING_LIBRARY = ("structured output (json_object, json_schema, regex, ebnf) needs the llguidance library: "
                   "pip install 'tiermoe[structured]'")
# json.dumps' layout and no free whitespace (see above); defaults, so a schema's "x-guidance" can override them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per compiler (clients tend to resend the same few schemas)



# Up to this many rows, masks are computed one after another: waking llguidance's thread pool costs ~150 us a step,
# while a row's mask is ~1-30 us for common grammars (more only for long constrained strings on a large vocabulary).
SERIAL_MASK_ROWS = 4


class GrammarCompiler:
    """Compiles grammars for one tokenizer and one logits width; thread-safe (requests compile, the engine steps).

    `vocab_size` is the model's logits width, which may exceed the tokenizer's vocabulary (padded embeddings):
    ids past the tokenizer's are never allowed. `eos_token_ids` are the ids that end a sequence (default: the
    tokenizer's EOS): a grammar allows them once it is complete, and only then.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: int | Sequence[int] | None = None,
                 cache_size: int = CACHE_SIZE):
        if llguidance is None:
            raise TiermoeError(MISSING_LIBRARY)
        backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer under a fast HF tokenizer
        if backend is None:
            raise TiermoeError(f"structured output needs a fast (tokenizers-backed) tokenizer, this model has a "
                               f"{type(tokenizer).__name__}")
        eos = _eos_list(tokenizer, eos_token_ids)
        backend = copy(backend)  # padding and truncation are tokenizer state: off on a copy before serializing
        backend.no_padding()
        backend.no_truncation()
        # llguidance's ids must cover the tokenizer's (added tokens included) and the logits' width
        n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.mask_words = (n_vocab + 31) // 32  # int32 words of one row's bitmask
        # EOS's bits (the words holding them, and each word with them cleared), for rows that must go on past them
        self._eos_words = numpy.array(sorted({t // 32 for t in eos}), dtype=numpy.int64)
        self._eos_cleared = numpy.array([~sum(1 << t % 32 for t in eos if t // 32 == w) & 0xFFFFFFFF
                                         for w in self._eos_words], dtype=numpy.uint32)
        try:
            self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        except ValueError as err:  # a tokenizer llguidance cannot read (e.g. a decoder kind it does not know)
            raise TiermoeError(f"structured output cannot use this model's tokenizer (llguidance: "
                               f"{_one_line(str(err))})") from None
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # no parser dumps in a 400's message
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._executor = None  # llguidance's thread pool, made on the first step with two constrained rows
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def compile(self, kind: str, source: str | dict | None = None) -> CompiledGrammar:
        """The grammar of `kind` from `source` (cached by both); TiermoeError says what is wrong or unsupported."""
        key = (kind, _canonical_source(kind, source))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # outside the lock: a large grammar takes a while and llguidance drops the GIL meanwhile
        matcher = llguidance.LLMatcher(self._tokenizer, _llguidance_grammar(*key), log_level=0, limits=self._limits)
        if matcher.is_error():
            raise TiermoeError(f"{kind}: {_one_line(matcher.get_error())}")
        grammar = CompiledGrammar(self, kind, matcher)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def masks_bias(self, states: Sequence[GrammarState], like: torch.Tensor,
                   going_on: Sequence[bool] = ()) -> torch.Tensor:
        """[len(states), like's width] of 0 (allowed) and -inf (not), in like's dtype on like's device. A row whose
        `going_on` is True has EOS left out while its grammar allows any other token (a sequence with ignore_eos)."""
        bits = torch.empty(len(states), self.mask_words, dtype=torch.int32)
        row_bytes = self.mask_words * 4
        if len(states) <= SERIAL_MASK_ROWS:
            for row, state in enumerate(states):
                state.matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                                   bits.data_ptr(), row_bytes, len(states))
        for row in (r for r, drop in enumerate(going_on) if drop):
            self._leave_out_eos(bits[row].numpy().view(numpy.uint32))
        # The bitmask (32x smaller than the logits) crosses to the device and is expanded there. Bit k of word w
        # is token 32w + k, so on a little-endian host byte b holds tokens 8b..8b+7: a 256-row table of 8 biases
        # turns each byte into its 8 entries (one gather, no branches: masked_fill_ on a mixed mask is slower).
        index = bits.to(like.device).view(torch.uint8).view(-1).int()
        bias = self._table(like.device, like.dtype).index_select(0, index).view(len(states), -1)
        width = like.shape[-1]
        if width > bias.shape[1]:
            raise ValueError(f"logits are {width} wide, the compiler's vocab_size is {self.vocab_size}")
        return bias[:, :width]

    def _leave_out_eos(self, words: numpy.ndarray) -> None:
        """Clears EOS's bits of one row's bitmask, in place, unless nothing else would be left (the grammar is
        complete: EOS is all that may follow)."""
        kept = words[self._eos_words]
        words[self._eos_words] &= self._eos_cleared
        if not words.any():
            words[self._eos_words] = kept

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._tables:
            bit_set = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [byte value, bit]
            self._tables[key] = torch.zeros(256, 8, dtype=dtype).masked_fill_(bit_set == 0, float("-inf")).to(device)
        return self._tables[key]


class CompiledGrammar:
    """A compiled grammar, shared by every request that sends the same source; `new_state` for each sequence."""

    def __init__(self, compiler: GrammarCompiler, kind: str, matcher):
        self.compiler = compiler
        self.kind = kind
        self._matcher = matcher  # never advanced: states start from copies of it

    def new_state(self) -> GrammarState:
        return GrammarState(self.compiler, self._matcher.deep_copy())  # ~10 us: no recompiling


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe: the engine's step thread owns it."""

    def __init__(self, compiler: GrammarCompiler, matcher):
        self.compiler = compiler
        self.matcher = matcher
        self.num_accepted = 0

    def allowed_mask(self, logits_V: torch.Tensor) -> torch.Tensor:
        """Bool [V] on the logits' device: the tokens the grammar allows next."""
        return self.compiler.masks_bias([self], logits_V)[0] == 0

    def apply(self, logits_V: torch.Tensor) -> torch.Tensor:
        """Sets the logits of disallowed tokens to -inf, in place (allowed ones keep their values); returns them."""
        return apply_masks(logits_V.unsqueeze(0), [self])[0]

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (and no change) if the grammar does not allow it here."""
        if self.matcher.try_consume_tokens([token_id]) != 1:
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (the engine drops a token it could not keep)."""
        if not 0 <= num_tokens <= self.num_accepted or not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        self.num_accepted -= num_tokens

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS: stop the sequence here ("stop")."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed), though it may go on (a regex's `\\d+`)."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped on an error (a parser resource limit hit mid-reply), else None; a state in error
        allows only EOS and reads as finished."""
        return _one_line(self.matcher.get_error()) if self.matcher.is_error() else None


def apply_masks(logits_BV: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Masks row i of `logits_BV` with states[i], in place; rows whose state is None are not read or written
    (and a batch with no state costs one pass over the list). Returns logits_BV."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return logits_BV
    if len(states) != logits_BV.shape[0]:
        raise ValueError(f"{len(states)} states for {logits_BV.shape[0]} rows of logits")
    bias = states[rows[0]].compiler.masks_bias([states[i] for i in rows], logits_BV)
    if len(rows) == len(states):
        logits_BV.add_(bias)  # x + 0 is x; x + -inf is -inf
    else:
        for j, i in enumerate(rows):  # row by row: no index tensor to ship to the device
            logits_BV[i].add_(bias[j])
    return logits_BV


def _eos_list(tokenizer, eos_token_ids) -> list[int]:
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_id", None)
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
    if not eos:
        raise TiermoeError("structured output needs an end-of-sequence token; this tokenizer has none")
    return eos


def _canonical_source(kind: str, source) -> str:
    """The source as the cache key and llguidance's input; TiermoeError for a wrong kind or source type."""
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as err:
                raise TiermoeError(f"json_schema is not valid JSON: {err}") from None
        if source is False:
            raise TiermoeError("json_schema: the schema false admits no reply")
        source = {} if source is True else source  # the schema true: any JSON value, as {} says it
        if not isinstance(source, dict):
            raise TiermoeError(f"json_schema must be a JSON object (or true/false), got {type(source).__name__}")
        try:  # key order kept: properties are generated in the schema's order
            return json.dumps(source, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise TiermoeError(f"json_schema is not JSON-serializable: {err}") from None
    if kind in ("regex", "ebnf"):
        if not isinstance(source, str) or not source:
            raise TiermoeError(f"{kind} must be a non-empty string")
        if kind == "regex" and (len(source) - len(source.rstrip("\\"))) % 2:  # regex_to_lark would drop it
            raise TiermoeError(f"regex: invalid regex {source!r}: a trailing backslash escapes nothing")
        return source
    raise TiermoeError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")


def _llguidance_grammar(kind: str, source: str) -> str:
    """llguidance's grammar text for a canonical source (its errors surface when a matcher is built from it)."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if kind == "regex":  # \d and \w as ASCII, as in JSON-schema patterns (ECMAScript) and xgrammar, not Unicode
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(source, 'dw')}/")
    try:  # GBNF (llama.cpp / xgrammar `root ::= ...`) is converted; a Lark grammar passes through
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
    except Exception as err:  # noqa: BLE001 - the converter raises its own error types for bad grammars
        raise TiermoeError(f"ebnf: {_one_line(str(err))}") from None


def _one_line(message: str) -> str:
    """llguidance's multi-line error as one line: the headline and the regex parser's `error:` line, without the
    grammar listing and carets (positions in the grammar text llguidance generated, meaningless to the client)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    lines = [line for line in lines if line and not re.match(r"^(\d+ \||\^)", line)]
    if not lines:
        return "invalid grammar"
    keys = re.fullmatch(r"Unimplemented keys: \[(.*)\]", lines[0])
    if keys:
        return f"unsupported JSON-schema keyword(s): {keys.group(1)}"
    head = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    head = head.replace(" (in regex)", "").removesuffix("regex parse error:").rstrip(" :")
    detail = next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), None)
    if detail is None:
        return head
    if not head and len(lines) > 1:  # a schema `pattern`: the parser's second line is the pattern
        head = f"invalid pattern {lines[1]!r}"
    return f"{head}: {detail}" if head else detail
