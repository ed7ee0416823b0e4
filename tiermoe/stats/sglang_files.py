"""A recorder's dump as the files SGLang writes (`srt/eplb/expert_distribution.py`), with tiermoe's extras beside.

SGLang's layouts (what its own scripts and `--init-expert-location` read):
- stat / stat_approx, `expert_distribution_recorder_{time}.pt`: `rank`, `logical_count` int32 [buf, L, E],
  `average_utilization_rate_over_window` (the recorder writes these as they are);
- per_pass / per_token, `expert_distribution_recorder_{time}_{rank}.pt`: `records` (one dict per forward pass)
  and `last_physical_to_logical_map` int64 [L, E] (physical slot -> logical expert; tiermoe has no redundant
  experts, so the identity). A per_pass record is `forward_pass_id`, `rank`, `gatherer_key` ("primary") and
  `global_physical_count` int32 [L, E]; a per_token record adds the pass's `input_ids`, `positions` (lists, one per
  token), `extend_seq_lens` (tokens per sequence; None for a decode pass), `forward_mode` (SGLang's ForwardMode:
  1 extend, 2 decode, 3 mixed), `topk_ids_of_layer` int32 [L, T, 8] (-1 where nothing was routed: dense layers,
  columns past top-k) and `misc_objects` ([]);
- GPU-tier snapshots (SGLang-kt), `gpu_expert_distribution_{time}.pt`: `gpu_expert_masks` bool [buf, L, E].

tiermoe's extras are keys SGLang never reads: the dump header (format, mode, model shape, ...) and totals at the top
level, a `logical_count` [1, L, E] int64 at the top of per_pass/per_token files too (so every mode feeds
`--init-expert-location`), and per record `num_prefill_tokens`, `num_decode_tokens`, `num_sequences` (per_pass)
or `request_ids`, `seq_lens`, `seq_is_prefill` (per_token, one entry per sequence of the pass). A per_token
record's `input_ids` are the pass's token ids as the engine fed them (-1 in files from before tiermoe recorded
them).
"""

from __future__ import annotations

import torch

GPU_MASK_KEYS = ("gpu_expert_masks", "gpu_expert_masks_pass_index")
STAT_MODES = ("stat", "stat_approx")
DETAIL_MODES = ("per_pass", "per_token")
GATHERER_KEY = "primary"
FORWARD_MODE_EXTEND, FORWARD_MODE_DECODE, FORWARD_MODE_MIXED = 1, 2, 3
SGLANG_TOP_K_WIDTH = 8  # SGLang's per_token buffer is 8 wide (DeepSeek-V3's top-k); wider top-k widens it


def sglang_files(dump: dict) -> tuple[dict, dict | None]:
    """(the counts file's dict, the GPU masks file's dict or None) of a recorder's dump, in SGLang's layouts."""
    masks = {k: dump[k] for k in GPU_MASK_KEYS if k in dump}
    main = {k: v for k, v in dump.items() if k not in GPU_MASK_KEYS}
    if "records" not in main:
        if main.get("mode") == "per_pass":
            main = per_pass_file(main)
        elif main.get("mode") == "per_token":
            main = per_token_file(main)
    return main, (masks or None)


def identity_map(num_layers: int, num_experts: int) -> torch.Tensor:
    return torch.arange(num_experts, dtype=torch.int64).repeat(num_layers, 1)


def per_pass_file(dump: dict) -> dict:
    counts_PLE = dump["logical_count"]
    records = [
        {"forward_pass_id": int(p), "rank": 0, "gatherer_key": GATHERER_KEY,
         "global_physical_count": counts_PLE[i].to(torch.int32),
         "num_prefill_tokens": int(dump["num_prefill_tokens"][i]), "num_decode_tokens": int(dump["num_decode_tokens"][i]),
         "num_sequences": int(dump["num_sequences"][i])}
        for i, p in enumerate(dump["pass_index"].tolist())]
    moved = ("logical_count", "pass_index", "num_prefill_tokens", "num_decode_tokens", "num_sequences")
    return {"records": records, "last_physical_to_logical_map": identity_map(dump["num_layers"], dump["num_experts"]),
            **{k: v for k, v in dump.items() if k not in moved},
            "logical_count": counts_PLE.sum(dim=0, keepdim=True, dtype=torch.int64),
            "num_prefill_tokens": int(dump["num_prefill_tokens"].sum()),
            "num_decode_tokens": int(dump["num_decode_tokens"].sum())}


def per_token_file(dump: dict) -> dict:
    L, E, K = dump["num_layers"], dump["num_experts"], dump["top_k"]
    moe_layers = list(dump["moe_layers"])
    pass_N = dump["token_pass"].tolist()
    records, start = [], 0
    while start < len(pass_N):
        end = start
        while end < len(pass_N) and pass_N[end] == pass_N[start]:
            end += 1
        records.append(_token_record(dump, start, end, L, E, K, moe_layers))
        start = end
    moved = ("token_pass", "token_request", "token_position", "token_is_prefill", "topk_ids")
    return {"records": records, "last_physical_to_logical_map": identity_map(L, E),
            **{k: v for k, v in dump.items() if k not in moved}}


def _token_record(dump: dict, start: int, end: int, L: int, E: int, K: int, moe_layers: list[int]) -> dict:
    T = end - start
    positions = dump["token_position"][start:end].tolist()
    requests = dump["token_request"][start:end].tolist()
    prefill = dump["token_is_prefill"][start:end].tolist()
    seqs: list[list] = []  # [request, rows, is_prefill]; a sequence is a run of one request's consecutive positions
    for i in range(T):
        if seqs and seqs[-1][0] == requests[i] and positions[i] == positions[i - 1] + 1:
            seqs[-1][1] += 1
        else:
            seqs.append([requests[i], 1, bool(prefill[i])])
    kinds = {s[2] for s in seqs}
    mode = FORWARD_MODE_MIXED if len(kinds) > 1 else FORWARD_MODE_EXTEND if True in kinds else FORWARD_MODE_DECODE
    topk_LTW = torch.full((L, T, max(SGLANG_TOP_K_WIDTH, K)), -1, dtype=torch.int32)
    topk_LTW[moe_layers, :, :K] = dump["topk_ids"][start:end].to(torch.int32).permute(1, 0, 2)
    valid = topk_LTW >= 0
    count_LE = torch.zeros(L, E, dtype=torch.int32)
    count_LE.scatter_add_(1, topk_LTW.masked_fill(~valid, 0).reshape(L, -1).long(), valid.reshape(L, -1).int())
    return {"forward_pass_id": int(dump["token_pass"][start]), "rank": 0, "gatherer_key": GATHERER_KEY,
            "input_ids": dump["token_input_id"][start:end].tolist() if "token_input_id" in dump else [-1] * T,
            "positions": positions,
            "extend_seq_lens": None if mode == FORWARD_MODE_DECODE else [s[1] for s in seqs],
            "forward_mode": mode, "topk_ids_of_layer": topk_LTW, "misc_objects": [],
            "global_physical_count": count_LE,
            "request_ids": [s[0] for s in seqs], "seq_lens": [s[1] for s in seqs],
            "seq_is_prefill": [s[2] for s in seqs]}
