"""A checkpoint's multi-token-prediction (MTP) module (DeepSeek-V3/R1's and GLM-4.5's `num_nextn_predict_layers`),
run on the engine's ragged steps.

At position i it takes the target model's final hidden state h_i (after the model's last norm, as SGLang and vLLM
hand it over) and the embedding of the token at i + 1, and gives the distribution of the token at i + 2:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]);  x = decoder_layer(x);  h' = shared_head.norm(x)
    logits = shared_head.head(h')   (the model's LM head where the checkpoint stores none)

The decoder layer is a full one (its own attention, whose K/V live in the engine's pool as one more layer, at
index num_hidden_layers; its MoE block a HybridMoE whose experts sit on the GPU tier or the CPU tier like any
layer's). Drafting k tokens chains it: h' and the drafted token feed the next position (SGLang's
--speculative-num-steps). Positions are the target's (i), as SGLang and vLLM run it; transformers' reference
(MtpLayer) ropes with i + 1, which attention cannot tell apart (rope scores depend on position differences only).
Legend: T rows of the step, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.layers.paged_attention import STEP_KWARG, PagedStepCache
from tiermoe.layers.ragged_step import RaggedStep

# A ready-made 4-D mask: the attention parts take the step's own masks (as the engine's model forward does).
_NO_MASK = torch.zeros(1, 1, 0, 0)


class MTPModule(nn.Module):
    def __init__(self, enorm: nn.Module, hnorm: nn.Module, eh_proj: nn.Linear, layer: nn.Module, norm: nn.Module,
                 head: nn.Module, embed: nn.Module, rotary: nn.Module, layer_idx: int):
        """`embed`, `rotary` (and `head` where the checkpoint stores none): the target model's own modules."""
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.layer, self.norm = enorm, hnorm, eh_proj, layer, norm
        self.head = head
        self.layer_idx = layer_idx  # the pool's layer of its K/V
        # the target's modules, held without registering them (they are the model's, not this module's weights)
        self.__dict__["embed"], self.__dict__["rotary"] = embed, rotary

    def forward(self, ids_1T: torch.Tensor, hidden_1TD: torch.Tensor, step: RaggedStep,
                cache: PagedStepCache) -> torch.Tensor:
        """One ragged step: ids_1T the tokens at i + 1, hidden_1TD the hidden states at i (target's or a previous
        MTP output), written to the pool at the step's positions i. Returns h' [1, T, D] (its norm applied)."""
        embedded = self.embed(ids_1T).to(hidden_1TD.dtype)
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden_1TD)), dim=-1))
        position_embeddings = self.rotary(x, step.position_ids)
        x = self.layer(x, attention_mask=_NO_MASK, position_ids=step.position_ids, cache=cache, use_cache=True,
                       position_embeddings=position_embeddings, **{STEP_KWARG: step})
        return self.norm(x)

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, V] (fp32)."""
        return self.head(hidden_ND).float()
