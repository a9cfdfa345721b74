"""The scheduler: which queued asks make the next round, as a pure function of the queue and the pool.

State-ready traversal (RadixFlow): in queue order, each ask looks up the furthest checkpoint matching its
trunk; an ask whose trunk continues another admitted request's past that request's save point forks from it
in this very round (its trunk computed from the state there: a session and its forks asked together take one
round), one fork per save point; a second such ask, and any in the batch-invariant mode, waits for the
checkpoint in the next round, while the scan goes on filling the round with independent work up to its token,
state-row, piece and history-page limits. Asks with identical trunks share one request (its trunk computed
once). A round always admits its first ask, however large; cancelled asks are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flide_sdk.device.pool import Checkpoint
from flide_sdk.plan.layout import PAGE
from flide_sdk.serve.asks import Ask, TrunkKey
from flide_sdk.text.history import BLOCK, Trunk

DEFER_MIN_TOKENS = 64
"""An ask forks from (or waits for) a save point of the same round only if it saves this many more trunk
tokens (at least BLOCK: producers are found by the hash of their first block)."""


@dataclass(frozen=True)
class RoundLimits:
    """What one round holds at most: stream tokens, scratch state rows (`requests`: one per distinct trunk, one
    per piece others continue, one per request a fork continues), pieces besides the root trunks (`questions`:
    a question's, its options', two per fork's trunk), and history pages its resumed requests read (None: no
    limit); and where a round saves its checkpoints: at the stable boundary rounded down to a multiple of
    `save_align` (the batch-invariant mode: the GDN chunk). In the batch-invariant mode short siblings never
    share GDN chunk rows (`plan.tree.pack_siblings`) and an ask never forks from another in the round (it
    waits for its checkpoint): both change what a question's sums add up with."""

    tokens: int
    requests: int
    questions: int
    pages: int | None = None
    save_align: int = 1
    batch_invariant: bool = False

    def save_point(self, trunk: Trunk) -> int:
        return trunk.boundary // self.save_align * self.save_align


@dataclass(eq=False)
class Request:
    """Asks sharing one trunk, and the checkpoint they resume from (None: from the start); or, with a
    `parent`, a fork computed in its parent's round: its trunk continues the parent's from `fork_at` (the
    parent's save point). `forks`: the requests forking from this one in the round."""

    asks: list[Ask]
    resume: Checkpoint | None
    parent: Request | None = None
    fork_at: int = 0
    forks: list[Request] = field(default_factory=list)
    trunk: Trunk = field(init=False)  # its asks' (kept should they all be cancelled while its forks are not)

    def __post_init__(self) -> None:
        self.trunk = self.asks[0].trunk

    @property
    def lead(self) -> Ask:
        return self.asks[0]

    @property
    def resume_length(self) -> int:
        return self.fork_at if self.parent is not None else 0 if self.resume is None else self.resume.length

    def tree(self) -> list[Request]:
        """This request and its forks, depth first (the order the round lays out their questions)."""
        return [self, *(request for fork in self.forks for request in fork.tree())]


@dataclass(eq=False)
class RoundBatch:
    """The next round's requests, and the asks left queued (in queue order) with how many of them wait for a
    checkpoint this round writes."""

    requests: list[Request] = field(default_factory=list)
    kept: list[Ask] = field(default_factory=list)
    deferred: int = 0
    rows: int = 0  # scratch state rows its requests use

    @property
    def asks(self) -> list[Ask]:
        return asks_of(self.requests)


def asks_of(requests: Iterable[Request]) -> list[Ask]:
    """The asks of `requests` and of their forks, in tree order (the order of their questions in a round)."""
    return [ask for root in requests for request in root.tree() for ask in request.asks]


def waits_for(ask: Ask, resume_length: int, producer: Request, at: int) -> bool:
    """Whether `ask` (resuming `resume_length` tokens) should rather continue `producer`'s state at its save
    point `at` in this round (a fork of it) or from its checkpoint in the next: worth it only when it saves
    DEFER_MIN_TOKENS more."""
    trunk, theirs = ask.trunk, producer.trunk
    if not resume_length + DEFER_MIN_TOKENS <= at < len(trunk) or at <= producer.resume_length:
        return False
    blocks = at // BLOCK  # when both hashes are stored, they give a quick no before comparing tokens
    ours = trunk.block_hash(blocks) if blocks <= trunk.boundary // BLOCK else None
    if ours is not None and ours != theirs.block_hash(blocks):
        return False
    return trunk.prefix_equals(theirs.buffer, at) and not ask.same_trunk(producer.lead)


def schedule(queue: Iterable[Ask], lookup: Callable[[Trunk], Checkpoint | None], limits: RoundLimits) -> RoundBatch:
    """The next round from the queued asks, in order. `lookup` finds an ask's furthest checkpoint."""
    batch = RoundBatch()
    by_trunk: dict[TrunkKey, list[Request]] = {}
    by_first_block: dict[int, list[Request]] = {}
    tokens = questions = pages = rows = 0
    for ask in queue:
        if ask.future.cancelled():
            continue
        resume = lookup(ask.trunk)
        resume_length = 0 if resume is None else resume.length
        first_block = ask.first_block
        key = ask.trunk_key
        shared = next((r for r in by_trunk.get(key, ()) if r.lead.same_trunk(ask)), None)
        producer = None
        if shared is None:  # the furthest save point it continues (a fork's, past its parent's)
            producer = max((p for p in by_first_block.get(first_block, ())
                            if waits_for(ask, resume_length, p, limits.save_point(p.trunk))),
                           key=lambda p: limits.save_point(p.trunk), default=None)
        # one fork per save point (the next waits for its checkpoint), none in the batch-invariant mode
        if producer is not None and (producer.forks or limits.batch_invariant):
            batch.kept.append(ask)
            batch.deferred += 1
            continue
        fork_at = 0 if producer is None else limits.save_point(producer.trunk)
        cost = ask.branch_tokens + (0 if shared else len(ask.trunk) - max(resume_length, fork_at))
        history = 0 if shared or producer else -(-resume_length // PAGE)
        # state rows: a trunk's, one per piece others continue, and a split row for a request with a fork
        new_rows = (0 if shared else 1) + (producer is not None and not producer.forks) + ask.branches.inner
        pieces = len(ask.branches.lengths) + 2 * (producer is not None)  # a fork's trunk: two pieces
        full = (tokens + cost > limits.tokens or rows + new_rows > limits.requests
                or questions + pieces > limits.questions
                or limits.pages is not None and pages + history > limits.pages)
        if batch.requests and full:
            batch.kept.append(ask)
            continue
        if shared is not None:
            shared.asks.append(ask)
        else:
            if producer is not None:
                request = Request([ask], None, producer, fork_at)
                producer.forks.append(request)
            else:
                request = Request([ask], resume)
                batch.requests.append(request)
            by_trunk.setdefault(key, []).append(request)
            if first_block is not None:
                by_first_block.setdefault(first_block, []).append(request)
        tokens += cost
        rows += new_rows
        questions += pieces
        pages += history
    batch.rows = rows
    return batch
