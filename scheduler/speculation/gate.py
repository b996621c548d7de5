"""The speculation gate: how many draft tokens each decoding request verifies this step.

A verify row costs what a token in the pass costs; a draft token pays when its chance of being
accepted buys more tokens per second than the step already makes. Both sides are measured on
this machine and this traffic, never assumed:

- ``StepCost``: a forward pass's seconds as ``a + b * tokens``, fitted to the passes the loop
  timed that held only decodes and verifies (every row computes logits, as a draft row does).
  On a CPU, where a step streams the weights, ``b`` is a small part of ``a`` and drafts are
  cheap at batch 1; as the batch grows the pass turns compute-bound, ``b`` dominates and the
  gate stops drafting.
- ``Acceptance``: per request, draft source and match length (1-4 tokens: a longer match is
  right more often), the chance a draft token is accepted given the ones before it were
  (successes over trials, older outcomes decayed); its prior is what the same source and length
  have scored across all requests lately (``traffic``: a new request of a chat trace, whose
  short matches are mostly wrong, does not pay rows to learn that again), starting from a
  constant per source and length; while its drafts go unused it drifts back to that prior, so
  a request that starts repeating itself later is tried again.

Drafts are then granted greedily, best expected gain first: the i-th token of a draft with
acceptance ``p`` is worth ``p**i`` tokens for ``b`` seconds, taken while that beats the step's
tokens per second including what was granted so far.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Request
from scheduler.speculation.drafter import LONGEST_NGRAM, Draft, DraftSource

# Acceptance priors of a draft read after a match of LONGEST_NGRAM tokens or more, per source,
# and their share for shorter matches (on the spec_bench traces, a 1-token match of the
# request's own context was accepted 25-57% of the time, a 4-token one 70-96%).
PRIORS = {DraftSource.TREE: 0.9, DraftSource.CONTEXT: 0.6, DraftSource.PEER: 0.5,
          DraftSource.NAMESPACE: 0.5}
SHORT_MATCH_SHARE = {1: 0.5, 2: 0.7, 3: 0.85}
PRIOR_WEIGHT = 1.0  # trials the prior counts for
HISTORY_DECAY = 0.9  # weight of older outcomes at each verify of one request
TRAFFIC_DECAY = 0.99  # the same across all requests (about the last hundred verifies)
TRAFFIC_IDLE_DECAY = 0.99  # per offer of any request left unverified
IDLE_DECAY = 0.95  # per step a draft was offered but not verified: back toward the prior
# Passes up to this many tokens are fitted (a long prefill's cost says little about decode).
COST_MAX_TOKENS = 256
COST_DECAY = 0.99  # weight of older passes in the fit
COST_MIN_PASSES = 8
# Before the fit can see a slope: one more token costs this share of a one-token pass.
PRIOR_TOKEN_SHARE = 1 / 16


class StepCost:
    """Seconds of a forward pass of ``n`` tokens, ``a + b * n``, least squares over the timed
    passes (exponentially weighted: the machine's speed drifts)."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.passes = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > COST_MAX_TOKENS or seconds <= 0:
            return
        d = COST_DECAY
        self._w = self._w * d + 1.0
        self._n = self._n * d + tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + tokens * tokens
        self._nt = self._nt * d + tokens * seconds
        self.passes += 1

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, or None before any pass was timed."""
        if self.passes == 0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if self.passes >= COST_MIN_PASSES and var > 0.25:
            b = (self._nt / self._w - mean_n * mean_t) / var
            a = mean_t - b * mean_n
            if b > 0 and a > 0:
                return a, b
        # No slope to see yet (every pass the same size) or noise: the prior's shape.
        a = mean_t / (1 + PRIOR_TOKEN_SHARE * mean_n)
        return a, a * PRIOR_TOKEN_SHARE


@dataclass
class Acceptance:
    """Decayed successes and trials of drafts from one source and match length (one request's,
    or the traffic's)."""

    prior: float
    successes: float = 0.0
    trials: float = 0.0
    decay: float = HISTORY_DECAY
    idle_decay: float = IDLE_DECAY

    @property
    def rate(self) -> float:
        return (self.successes + self.prior * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        # Trials end at the first rejected token: the ones after it were never judged.
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (accepted < drafted)

    def idle(self) -> None:
        self.successes *= self.idle_decay
        self.trials *= self.idle_decay


def _kind(draft: Draft) -> tuple[DraftSource, int]:
    """What the gate learns acceptance per: the source and the match length (capped: the
    tree's continuation matches a whole sequence)."""
    assert draft.source is not None
    return draft.source, min(draft.match, LONGEST_NGRAM)


@dataclass
class Candidate:
    """A decoding request with a proposed draft, before the gate decides."""

    request: Request
    draft: Draft


class SpeculationGate:
    """Grants draft tokens per step; learns from the loop's timings and the verify results."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self._acceptance: dict[tuple[Request, DraftSource, int], Acceptance] = {}
        self._traffic: dict[tuple[DraftSource, int], Acceptance] = {}

    def traffic(self, draft: Draft) -> Acceptance:
        """Every request's outcomes for ``draft``'s kind (source and match length)."""
        source, match = kind = _kind(draft)
        found = self._traffic.get(kind)
        if found is None:
            prior = PRIORS[source] * SHORT_MATCH_SHARE.get(match, 1.0)
            found = self._traffic[kind] = Acceptance(prior, decay=TRAFFIC_DECAY,
                                                        idle_decay=TRAFFIC_IDLE_DECAY)
        return found

    def acceptance(self, request: Request, draft: Draft) -> Acceptance:
        """``request``'s own estimate for ``draft``'s kind, its prior being the traffic's
        current rate."""
        key = (request, *_kind(draft))
        prior = self.traffic(draft).rate
        found = self._acceptance.get(key)
        if found is None:
            found = self._acceptance[key] = Acceptance(prior)
        else:
            found.prior = prior
        return found

    def may_grant(self, pass_tokens: int, sampled: int) -> bool:
        """Whether even a draft sure to be accepted would pay in this pass (if not, nothing is
        proposed: a compute-bound step spends no time on lookups)."""
        fit = self.cost.fit()
        if fit is None:
            return False
        a, b = fit
        return a + b * pass_tokens > b * sampled

    def grant(
        self, candidates: list[Candidate], pass_tokens: int, sampled: int, budget: int
    ) -> list[int]:
        """Draft tokens to verify for each candidate (same order), in a pass that already has
        ``pass_tokens`` tokens of which ``sampled`` rows produce a token, with room for
        ``budget`` more."""
        granted = [0] * len(candidates)
        fit = self.cost.fit()
        if fit is None or budget <= 0:
            return granted
        a, b = fit
        offers: list[tuple[float, int]] = []
        for index, candidate in enumerate(candidates):
            p = self.acceptance(candidate.request, candidate.draft).rate
            worth = 1.0
            for _ in candidate.draft.tokens:
                worth *= p
                offers.append((worth, index))
        offers.sort(key=lambda offer: -offer[0])
        seconds = a + b * pass_tokens
        tokens = float(sampled)
        for worth, index in offers[:budget]:
            if worth * seconds <= b * tokens:  # worth / b <= tokens / seconds
                break
            granted[index] += 1
            tokens += worth
            seconds += b
        for candidate, k in zip(candidates, granted):
            if k == 0:  # both estimates drift back: a source nobody tries is tried again
                self.acceptance(candidate.request, candidate.draft).idle()
                self.traffic(candidate.draft).idle()
        return granted

    def record(self, request: Request, draft: Draft, drafted: int, accepted: int) -> None:
        """``drafted`` of ``draft``'s tokens were verified and ``accepted`` of them kept."""
        self.acceptance(request, draft).record(drafted, accepted)
        self.traffic(draft).record(drafted, accepted)

    def forget(self, request: Request) -> None:
        for source in DraftSource:
            for match in range(1, LONGEST_NGRAM + 1):
                self._acceptance.pop((request, source, match), None)
