"""The Python API users know from vLLM: `LLM(model).generate(prompts, SamplingParams(...))`.

Text, tokenizer and chat template live here, at the edge; the Engine underneath sees token ids only.
"""

from __future__ import annotations

import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoTokenizer

from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.checkpoint.gguf_reader import gguf_files
from tiermoe.config import DEFAULT_PAGE_SIZE, CPUConfig, DynamicPlacementConfig
from tiermoe.engine.dynamic import enable_dynamic_placement
from tiermoe.engine.engine import Engine, EngineConfig
from tiermoe.engine.generation_defaults import load_generation_defaults
from tiermoe.engine.logprobs import TokenLogprob
from tiermoe.engine.sampling import Grammar, SamplingParams
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.structured_output import CompiledGrammar, GrammarCompiler
from tiermoe.engine.text_stream import TextStream
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.model.plan_source import resolve_plan
from tiermoe.stats.recording import NO_RECORDER, ExpertRecorder


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: the generated part only (`text` ends before a matched stop string). A sequence that
    failed has finish_reason "error", the tokens it produced before, and `error` saying what failed. `logprobs`
    (one per token id) and `prompt_logprobs` (one per prompt id but the first) when the sampling asked for them."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class LLM:
    """A hybrid model ready to generate.

    model: checkpoint directory (None = the bundled demo model). gpu_device: "cuda:0", or "cpu" to run the GPU
    tier on the host. placement: a PlacementPlan, a bool tensor [num_layers, num_experts] (True = GPU tier), a
    PlacementConfig (planned against this checkpoint), or None (a mask the checkpoint carries, the KT
    environment variables, else all experts on the CPU tier); turned into a plan once, here
    (tiermoe.model.plan_source.resolve_plan). cpu: the CPU tier's backend, expert format and threads. recorder:
    sees every pass's routed experts (tiermoe.stats). dynamic: layerwise GPU prefill and placement that follows
    the workload (None = static placement). share: rank 0's part of a multi-rank run (tiermoe.distributed.
    RankModel builds it, and passes the plan for all ranks as `placement`). max_total_tokens: tokens the KV pool
    holds; None = the KV cache the plan reserved when GPU memory sized it, else what free memory allows
    (tiermoe.engine.pool_size). page_size: tokens per page of the pool. prefix_cache: a prompt that starts with
    pages already in the pool reuses them (tiermoe.engine.prefix_index). lora: a LoRA adapter merged into the
    weights as they load (tiermoe.training.adapter_merge.merged_lora reads one from a PEFT adapter directory).
    attention_backend: what decode rows attend the pool in place with ("auto", "native", "triton", "torch";
    tiermoe.layers.decode_attention.decode_attention_for). speculative: speculative decoding's settings
    (tiermoe.engine.speculative_config; None: off).
    """

    def __init__(self, model: str | Path | None = None, gpu_device: str = "cpu", placement=None,
                 dtype: torch.dtype | None = None, max_running: int = 16, prefill_chunk: int = 512,
                 max_total_tokens: int | None = None, cpu: CPUConfig = CPUConfig(),
                 recorder: ExpertRecorder = NO_RECORDER, dynamic: DynamicPlacementConfig | None = None,
                 progress: bool = True, share=None, page_size: int = DEFAULT_PAGE_SIZE, prefix_cache: bool = True,
                 lora: MergedLoRA | None = None, attention_backend: str = "auto",
                 speculative: SpeculativeConfig | None = None):
        self.model_dir = resolve_model(model)
        spec = detect(load_config(self.model_dir))
        num_gpus = 1 if share is None else share.num_ranks
        plan = resolve_plan(placement, self.model_dir, spec, num_gpus, gpu_device)
        # a plan sized by GPU memory reserved KV for this many tokens: without a budget of its own the engine keeps
        # to it, so the KV cache cannot grow into the memory the GPU experts were given
        max_total_tokens = max_total_tokens or plan.budget.get("kv_cache_tokens")
        self.hybrid = load_hybrid_model(self.model_dir, plan, gpu_device=gpu_device, dtype=dtype, cpu=cpu,
                                        progress=progress, share=share, lora=lora,
                                        attention_backend=attention_backend)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.generation_defaults = load_generation_defaults(self.model_dir)
        detokenize = detokenize_special = None
        if self.tokenizer is not None:
            def detokenize(ids):
                return self.tokenizer.decode(ids, skip_special_tokens=True)

            def detokenize_special(ids):  # a request's skip_special_tokens False
                return self.tokenizer.decode(ids, skip_special_tokens=False)
        self.engine = Engine(self.hybrid, eos_token_ids(self.model_dir, self.hybrid.config), detokenize,
                             EngineConfig(max_running, prefill_chunk, max_total_tokens, page_size, prefix_cache,
                                          speculative), recorder,
                             detokenize_special=detokenize_special)
        self.placement_manager = enable_dynamic_placement(self.engine, dynamic) if dynamic else None
        self._grammar_compiler: GrammarCompiler | None = None  # made on the first grammar (seconds on a 150k vocab)
        self._grammar_compiler_lock = threading.Lock()  # requests compile on their threads, the engine on its own
        if self.tokenizer is not None:
            self.engine.compile_grammar = self.compile_grammar

    @property
    def placement(self) -> torch.Tensor:
        """The current GPU-tier mask [num_layers, num_experts] (`self.hybrid.plan`: the same as a plan)."""
        return self.hybrid.mask

    def close(self) -> None:
        if self.placement_manager is not None:
            self.placement_manager.close()
        self.engine.close()
        self.hybrid.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TiermoeError(f"{self.model_dir} has no tokenizer; pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not all(isinstance(t, int) for t in prompt):
            raise TiermoeError("a prompt is a string or a list of integer token ids")
        return list(prompt)

    def default_sampling(self, **given) -> SamplingParams:
        """SamplingParams with the values `given` (None = not given) and, for the rest, the checkpoint's
        generation_config.json (temperature, top_p, top_k, max_new_tokens as max_tokens), as vLLM and SGLang use
        it; what neither sets keeps SamplingParams' default. `generate(prompt)` without SamplingParams uses it."""
        fallback = {"max_tokens": self.generation_defaults.max_tokens} if self.generation_defaults.max_tokens else {}
        return self.generation_defaults.params(fallback, **given)

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                 on_step=None) -> list[RequestOutput]:
        """Generate for one prompt or a list of them (strings or token-id lists), batched; one result each.
        `sampling`: one SamplingParams for every prompt, or a list of one per prompt (e.g. each with its own LoRA
        adapter, `adapter`, of those `engine.serve_adapters()` serves)."""
        sampling = self.default_sampling() if sampling is None else sampling
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        each = sampling if isinstance(sampling, list) else [sampling] * len(batch)
        if len(each) != len(batch):
            raise TiermoeError(f"{len(each)} SamplingParams for {len(batch)} prompts; give one, or one per prompt")
        seqs = [self.engine.add(self.encode(p), params) for p, params in zip(batch, each)]
        self.engine.run_to_completion(on_step)
        return [self._result(s) for s in seqs]

    def stream(self, prompt, sampling: SamplingParams | None = None):
        """Generate for one prompt, yielding text deltas as tokens arrive (the engine runs in this thread)."""
        if self.tokenizer is None:
            raise TiermoeError(f"{self.model_dir} has no tokenizer; streaming text needs one")
        sampling = self.default_sampling() if sampling is None else sampling
        seq = self.engine.add(self.encode(prompt), sampling)
        text = TextStream(self.engine.decoded_text(seq), sampling.stop)
        try:
            while not seq.finished:
                if seq in self.engine.step():
                    delta = text.delta(seq.output_ids, seq.finished, seq.stop_text_end)
                    if delta:
                        yield delta
            if seq.finish_reason == "error":
                raise (TiermoeError if seq.error_from_request else RuntimeError)(f"generation failed: {seq.error}")
        finally:
            if not seq.finished:
                self.engine.abort(seq)

    def chat(self, messages, sampling: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (list of {role, content}) or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise TiermoeError(f"{self.model_dir} has no tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, sampling)

    def chat_prompt_ids(self, conversation: list[dict], tools: list[dict] | None = None,
                        continue_final: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the chat template, with `tools` (OpenAI's function list) for templates that
        show them. `continue_final`: the reply continues the conversation's last (assistant) message rather than
        starting a new one. `template_kwargs`: variables the template reads (e.g. `enable_thinking`).
        A template that raises (Qwen3's "No user query found", a template's role alternation, tools it cannot show)
        refuses the conversation: a TiermoeError with its message, the caller's to fix (a server's 400)."""
        extra = {"tools": tools} if tools else {}
        if continue_final:
            extra["continue_final_message"] = True
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise TiermoeError("this model has no chat template: give a prompt (completions) rather than messages")
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=not continue_final,
                                                     tokenize=True, **extra, **(template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - whatever the template raised, it refused this conversation
            raise TiermoeError(f"the model's chat template refused this conversation ({type(err).__name__}: "
                               f"{str(err)[:300]})") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def compile_grammar(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` compiled for this model's tokenizer and logits (cached by its source); TiermoeError naming
        what is wrong or unsupported in it, or the missing library."""
        if self.tokenizer is None:
            raise TiermoeError(f"structured output ({grammar.kind}) needs the model's tokenizer; this model has none")
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.engine.vocab_size,
                                                         sorted(self.engine.eos_token_ids) or None)
        return self._grammar_compiler.compile(grammar.kind, grammar.source or None)

    def _result(self, seq) -> RequestOutput:
        text = None
        if self.tokenizer is not None and seq.stop_text_end is not None:  # an index into the text it was found in
            text = self.engine.decoded_text(seq).text[:seq.stop_text_end]
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        params = seq.params
        return RequestOutput(seq.prompt_ids, list(seq.output_ids), text, seq.finish_reason, seq.error,
                             list(seq.output_logprobs) if params.logprobs is not None else None,
                             list(seq.prompt_logprobs) if params.prompt_logprobs is not None else None)


def _load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer: its tokenizer files, or for GGUF the vocabulary in the (first) file's metadata
    (converted by transformers); None when there is none (prompts must then be token ids)."""

    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    files = gguf_files(model_dir)
    if not files:
        return None
    first = files[0]  # split files carry the tokenizer in the first one

    if "tokenizer.ggml.model" not in GGUFReader(str(first)).fields:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name, local_files_only=True)
    except (KeyError, ValueError, NotImplementedError) as err:  # a vocabulary transformers cannot convert
        warnings.warn(f"{first.name}: its tokenizer could not be converted ({err}); pass prompts as token ids",
                      stacklevel=2)
        return None


def eos_token_ids(model_dir: Path, config) -> set[int]:
    """EOS ids from generation_config.json (which may list several), else from config.json."""
    ids = None
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        try:
            ids = json.loads(gen_file.read_text()).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise TiermoeError(f"{gen_file} is not valid JSON ({err})") from None
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, list) else [ids])}
