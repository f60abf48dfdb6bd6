"""DSpark's markov (bigram) and confidence heads; names match vLLM's `DSparkMarkovHead`/`DSparkConfidenceHead`."""

import torch
from torch import nn


class MarkovHead(nn.Module):
    """`markov_w1[prev_token]` is an r-dim embedding; `markov_w2` maps it to a draft-vocab bias."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(markov_embed)


class ConfidenceHead(nn.Module):
    """Acceptance logit per slot from the final hidden state (and the markov embedding)."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
        # fp32, as vLLM keeps this head's parameters in fp32.
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)
