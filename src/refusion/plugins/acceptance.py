"""Built-in acceptance rules of the ``speculative`` decoder (:class:`~refusion.core.interfaces.AcceptanceRule`):
which drafts the target model accepts after one verification forward, and the token after them.

* ``greedy`` (temperature 0): the longest prefix of drafts equal to the target's argmax, then the target's
  argmax after it (the correction, or the bonus token when all n pass): AR greedy's tokens exactly.
* ``rejection_sampling`` (temperature > 0; Leviathan et al. 2023, Chen et al. 2023): draft d_i is accepted
  with probability min(1, p_i(d_i) / q_i(d_i)) (p: the target's softmax(logits / T); q: the distribution
  the draft was drawn from, a point mass for a deterministic proposer); at the first rejection the token
  is drawn from norm(max(0, p_i - q_i)) (from p_i where p_i = q_i), after n acceptances the bonus token
  from p_n. The output follows p exactly, whatever q is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import AcceptanceRule
from refusion.core.probs import row_argmax, tempered_softmax
from refusion.core.types import Acceptance


def leading_run(passed: Tensor) -> Tensor:
    """``passed [B, n]`` bool -> ``[B]`` long: the length of each row's leading all-True run."""
    return passed.long().cumprod(-1).sum(-1)


class Greedy(AcceptanceRule):
    sampling = False

    def accept(self, logits, draft_tokens, draft_probs, temperature, generator=None):
        n = draft_tokens.shape[-1]
        target = row_argmax(logits)  # [B, n+1]
        accepted = leading_run(draft_tokens == target[:, :n])  # [B]
        return Acceptance(accepted, target.gather(-1, accepted[:, None])[:, 0])


class RejectionSampling(AcceptanceRule):
    sampling = True

    def accept(self, logits, draft_tokens, draft_probs, temperature, generator=None):
        B, n, V = draft_tokens.shape[0], draft_tokens.shape[-1], logits.shape[-1]
        p = tempered_softmax(logits, temperature)  # [B, n+1, V] the target's distributions
        q = torch.zeros_like(p)  # [B, n+1, V] the proposer's; row n (the bonus position) stays 0
        if n:
            q[:, :n] = (draft_probs if draft_probs is not None
                        else torch.nn.functional.one_hot(draft_tokens, V).to(p.dtype))  # a point mass
        p_d = p[:, :n].gather(-1, draft_tokens[..., None])[..., 0]  # [B, n]
        q_d = q[:, :n].gather(-1, draft_tokens[..., None])[..., 0]  # [B, n]
        device = generator.device if generator is not None else logits.device
        u = torch.rand(B, n, generator=generator, device=device).to(logits.device)  # [B, n]
        passed = u * q_d < p_d  # [B, n]: accept d_i with probability min(1, p/q)
        residual = (p - q).clamp_min(0)  # [B, n+1, V]
        z = residual.sum(-1, keepdim=True)
        residual = torch.where(z > 0, residual / z.clamp_min(torch.finfo(p.dtype).tiny), p)  # p == q: draw from p
        drawn = torch.multinomial(residual.view(-1, V), 1, generator=generator).view(B, n + 1)  # [B, n+1]
        accepted = leading_run(passed)  # [B]
        return Acceptance(accepted, drawn.gather(-1, accepted[:, None])[:, 0])


@hookimpl
def register_acceptance_rules(register):
    register("greedy", Greedy)
    register("rejection_sampling", RejectionSampling)
