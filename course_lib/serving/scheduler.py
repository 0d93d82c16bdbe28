"""Iteration-level scheduling over a paged KV cache: continuous batching, chunked prefill,
preemption by recomputation and automatic prefix caching. Pure Python: no model, no tensor.

Introduced in notebooks/16_serving.ipynb; ``course_lib.serving.engine`` runs the batches it
makes through a transformers model and the course's paged attention.

A serving engine runs one forward pass per **step**, and the scheduler decides, before each one,
which tokens of which requests go into it:

* **Iteration-level scheduling** (Yu et al., "Orca: A Distributed Serving System for
  Transformer-Based Generative Models", OSDI 2022,
  https://www.usenix.org/conference/osdi22/presentation/yu): the batch is formed anew at every
  step, not once per request. A request joins at the first step after it arrives and leaves at
  the step that gives its last token, so a short request never waits for a long one to finish
  (*continuous batching*).
* **Chunked prefill and stall-free batching** (Agrawal et al., "Taming Throughput-Latency
  Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024, https://arxiv.org/abs/2403.02310):
  a step holds at most ``max_tokens_per_step`` tokens. Decoding requests go first, one token
  each; chunks of prompts fill the rest. A long prompt is spread over several steps, so the
  requests decoding beside it never stall behind it.
* **Paged blocks** (Kwon et al., "Efficient Memory Management for Large Language Model Serving
  with PagedAttention", SOSP 2023, https://arxiv.org/abs/2309.06180): a request's cache is a
  block table over ``course_lib.kvcache.BlockAllocator`` (lesson 13), blocks taken for the
  tokens scheduled. When the pool runs dry the most recently admitted request is **preempted**:
  its blocks are freed and it waits to be recomputed from its tokens (the paper's recomputation,
  §4.5), prompt and generated tokens alike.
* **Automatic prefix caching** (vLLM, https://docs.vllm.ai/en/latest/design/prefix_caching.html):
  a full block is named by a hash of (its parent block's hash, its tokens), so the name stands
  for the whole prefix up to the block's end. A new request whose leading full blocks are in
  the cache shares them (reference count + 1) and starts its prefill after them.

Two rules keep the sharing safe. Only full blocks are shared, and nobody writes to a full block
again, so no copy-on-write is needed. And at least the request's last token is always computed:
its logit is where the next token comes from, so a prompt found whole in the cache still runs
its last token (vLLM does the same).

A request's state is three numbers: its tokens (prompt, then the tokens generated so far),
``num_computed`` (how many of them have K and V in the cache) and its block table. Each step
runs tokens ``num_computed : num_computed + n``; the step that reaches the last token samples
one more. A decoding request is the case n = 1 with the newest token pending.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import math
from dataclasses import dataclass, field

from course_lib.kvcache import BlockAllocator, OutOfBlocks

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block: SHA-256 of its parent's name and its token ids.

    Chained this way, equal names mean equal prefixes, not just equal blocks. (vLLM hashes the
    same pair, plus extra keys such as a LoRA adapter's id; a cryptographic hash makes a
    collision, two prefixes sharing a block by mistake, a practical impossibility.)"""
    h = hashlib.sha256(parent or b"")
    h.update(repr(tuple(int(t) for t in tokens)).encode())
    return h.digest()


@dataclass(eq=False)
class Request:
    """One generation request and where it stands.

    ``output`` holds the tokens generated so far; ``tokens`` is prompt + output. ``num_computed``
    of them have K and V in the cache, in the blocks of ``block_table`` (physical block ids,
    logical block j first); ``block_hashes`` names its first full blocks. ``num_cached_tokens``
    counts the tokens found in the prefix cache instead of computed (over all admissions).
    """

    request_id: object
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    state: str = WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_step: int | None = None

    def __post_init__(self):
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        for name in ("max_new_tokens", "arrival_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (
                    1 if name == "max_new_tokens" else 0):
                raise ValueError(f"request {self.request_id!r}: {name} = {value!r}")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Generating: one token pending, the one sampled last step."""
        return bool(self.output) and self.num_uncomputed == 1


class PrefixCache:
    """Full blocks by name (``block_hash``), each held by one reference of the cache's own, so
    a block outlives the requests that filled it.

    A block that only the cache holds (reference count 1) is as good as free: ``evict`` gives
    back the least recently used of them when the allocator runs out. "Used" is a hit or a
    release; requests release their blocks last to first, so a prefix's tail is evicted before
    its head (vLLM's order: the head is the part other prompts are likelier to share)."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self._blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, name: bytes) -> int | None:
        block = self._blocks.get(name)
        if block is not None:
            self._blocks.move_to_end(name)
        return block

    def insert(self, name: bytes, block: int) -> None:
        """Remember a newly filled block (a name already known keeps its first block)."""
        if name not in self._blocks:
            self._blocks[name] = block
            self.allocator.incref(block)

    def touch(self, name: bytes) -> None:
        if name in self._blocks:
            self._blocks.move_to_end(name)

    @property
    def num_evictable(self) -> int:
        return sum(self.allocator.refcount(b) == 1 for b in self._blocks.values())

    def evict(self) -> bool:
        """Free the least recently used block that no request holds; False if there is none."""
        for name, block in self._blocks.items():
            if self.allocator.refcount(block) == 1:
                del self._blocks[name]
                self.allocator.decref(block)
                return True
        return False

    def clear(self) -> None:
        """Evict every block no request holds."""
        while self.evict():
            pass


@dataclass
class Chunk:
    """The tokens of one request in a step: ``token_ids`` at positions ``start, start + 1, …``
    (the tokens before ``start`` are in the cache already)."""

    request: Request = field(repr=False)
    token_ids: list[int]
    start: int
    block_table: list[int]  # the request's blocks, enough for start + len(token_ids) tokens
    is_decode: bool
    samples: bool  # reaches the request's last token: its last logit gives the next token

    @property
    def request_id(self):
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.start + len(self.token_ids)))

    @property
    def num_keys(self) -> int:
        """Keys the chunk's queries attend to: the cache up to and including this chunk."""
        return self.start + len(self.token_ids)


@dataclass
class Batch:
    """What one step runs: the chunks of the scheduled requests, packed one after another (as
    FlashAttention's varlen layout packs sequences), and the requests preempted to make room."""

    step: int
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for c in self.chunks for p in c.positions]

    @property
    def cu_seqlens_q(self) -> list[int]:
        """Offsets of the chunks in the packed tokens, [0, n_0, n_0 + n_1, …] (B + 1 of them)."""
        out = [0]
        for c in self.chunks:
            out.append(out[-1] + c.num_tokens)
        return out

    @property
    def seqlens_k(self) -> list[int]:
        return [c.num_keys for c in self.chunks]

    @property
    def sample_indices(self) -> list[int]:
        """Where, in the packed tokens, the logits to sample from are: each sampling chunk's
        last token."""
        cu = self.cu_seqlens_q
        return [cu[i + 1] - 1 for i, c in enumerate(self.chunks) if c.samples]

    def slot_mapping(self, block_size: int) -> list[int]:
        """Where each packed token's K and V go in the flattened pages: block · block_size +
        offset, the block from the token's position through its request's block table."""
        return [c.block_table[p // block_size] * block_size + p % block_size
                for c in self.chunks for p in c.positions]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_decode)


@dataclass(frozen=True)
class StepRecord:
    """One step, for a timeline: ``chunks`` is (request_id, "prefill" or "decode", tokens)."""

    step: int
    chunks: tuple
    prefill_tokens: int
    decode_tokens: int
    preempted: tuple
    num_waiting: int      # arrived and not running, after the step was formed
    available_blocks: int  # free, or held by the prefix cache alone


class Scheduler:
    """Forms each step's batch (``step``) and takes the sampled tokens back (``update``).

    >>> s = Scheduler(num_blocks=8, block_size=4, max_tokens_per_step=6)
    >>> r = s.add_request(list(range(10)), max_new_tokens=2)
    >>> [c.num_tokens for c in s.step().chunks]   # a 10-token prompt, 6 tokens a step
    [6]
    """

    def __init__(self, num_blocks: int, block_size: int = 16, max_tokens_per_step: int = 64,
                 max_running: int = 8, prefix_caching: bool = True, static: bool = False):
        for name, value in (("block_size", block_size), ("max_tokens_per_step",
                            max_tokens_per_step), ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_tokens_per_step = max_tokens_per_step
        self.max_running = max_running
        self.cache = PrefixCache(self.allocator) if prefix_caching else None
        self.static = bool(static)  # static batching, the baseline: see ``_admitting``
        self.static_batch: set = set()  # with ``static``: the ids of the batch being served
        self.requests: dict = {}
        self.pending: list[Request] = []  # not arrived yet, by arrival step
        self.waiting: list[Request] = []  # arrived, first come first served; preempted: in front
        self.running: list[Request] = []  # in the order they were admitted
        self.step_index = 0
        self.history: list[StepRecord] = []

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt, max_new_tokens: int, arrival_step: int = 0,
                    request_id=None) -> Request:
        """Queue a request; it can join the batch from step ``arrival_step`` on."""
        if request_id is None:
            request_id = len(self.requests)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is taken")
        request = Request(request_id, list(prompt), max_new_tokens, arrival_step)
        most = len(request.prompt) + max_new_tokens - 1  # the last token is never cached
        if math.ceil(most / self.block_size) > self.allocator.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {most} tokens of cache, more "
                             f"than the pool's {self.allocator.num_blocks} blocks hold")
        self.requests[request_id] = request
        bisect.insort(self.pending, request, key=lambda r: r.arrival_step)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    # -- blocks ---------------------------------------------------------------------------

    def num_available_blocks(self) -> int:
        """Free blocks, and blocks only the prefix cache holds (evicted when needed)."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return self.allocator.num_free + evictable

    def _blocks_needed(self, request: Request, n: int) -> int:
        return max(0, math.ceil((request.num_computed + n) / self.block_size)
                   - len(request.block_table))

    def _allocate(self, request: Request, n_blocks: int) -> None:
        for _ in range(n_blocks):
            if self.allocator.num_free == 0 and (self.cache is None or not self.cache.evict()):
                raise OutOfBlocks("no free block and none to evict")  # callers check first
            request.block_table.append(self.allocator.allocate())

    def _release(self, request: Request) -> None:
        """Drop the request's references, last block first (see ``PrefixCache``). Its
        ``block_hashes`` stay: the names of the blocks it filled."""
        for j in reversed(range(len(request.block_table))):
            self.allocator.decref(request.block_table[j])
            if self.cache is not None and j < len(request.block_hashes):
                self.cache.touch(request.block_hashes[j])
        request.block_table = []

    def _cached_prefix(self, request: Request) -> list[tuple[bytes, int]]:
        """(name, block) of the request's leading full blocks found in the prefix cache. Only
        blocks that end before the last token count: that token is always computed."""
        if self.cache is None:
            return []
        hits, parent, tokens, bs = [], None, request.tokens, self.block_size
        for j in range((request.num_tokens - 1) // bs):
            name = block_hash(parent, tokens[j * bs:(j + 1) * bs])
            block = self.cache.get(name)
            if block is None:
                break
            hits.append((name, block))
            parent = name
        return hits

    def _register_full_blocks(self, request: Request) -> None:
        """Name the blocks the request has just filled and put them in the prefix cache."""
        if self.cache is None:
            return
        tokens, bs = request.tokens, self.block_size
        while len(request.block_hashes) < request.num_computed // bs:
            j = len(request.block_hashes)
            parent = request.block_hashes[-1] if j else None
            name = block_hash(parent, tokens[j * bs:(j + 1) * bs])
            request.block_hashes.append(name)
            self.cache.insert(name, request.block_table[j])

    # -- admission, preemption, finishing -------------------------------------------------

    def _admit(self, request: Request, budget: int) -> int:
        """Start a waiting request: share its cached prefix, take blocks for its first chunk.
        Returns the chunk's length, or 0 (nothing changed) if its blocks are not available."""
        hits = self._cached_prefix(request)
        for _, block in hits:
            self.allocator.incref(block)  # now held: no longer evictable
        request.block_table = [block for _, block in hits]
        request.block_hashes = [name for name, _ in hits]
        request.num_computed = len(hits) * self.block_size
        n = min(request.num_uncomputed, budget)
        need = self._blocks_needed(request, n)
        if need > self.num_available_blocks():
            self._release(request)
            request.block_hashes, request.num_computed = [], 0
            return 0
        self._allocate(request, need)
        request.num_cached_tokens += request.num_computed
        request.state = RUNNING
        self.running.append(request)
        return n

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it waits, first in line, to be recomputed."""
        self._release(request)
        request.block_hashes, request.num_computed = [], 0
        request.state = WAITING
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.insert(0, request)

    def _make_room(self, request: Request, n: int, batch: Batch) -> bool:
        """Take the blocks ``n`` more tokens of a running request need, preempting the most
        recently admitted requests not yet in the batch until they fit (the request itself,
        if it is the newest). False if the request was preempted."""
        need = self._blocks_needed(request, n)
        scheduled = {id(c.request) for c in batch.chunks}
        while need > self.num_available_blocks():
            victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
            self._preempt(victim)
            batch.preempted.append(victim.request_id)
            if victim is request:
                return False
        self._allocate(request, need)
        return True

    def _finish(self, request: Request, step: int) -> None:
        self._release(request)
        request.state = FINISHED
        request.finish_step = step  # the step that gave its last token
        self.running.remove(request)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> Batch:
        """The next step's batch: decodes first, then the running prefills' next chunks, then
        new requests (first come, first served), within the token budget and the running
        limit. A running request that finds no block preempts the newest (``_make_room``); a
        new one that finds none waits, first in line."""
        batch = Batch(self.step_index)
        budget = self.max_tokens_per_step
        while self.pending and self.pending[0].arrival_step <= self.step_index:
            self.waiting.append(self.pending.pop(0))  # arrived: in line
        if self.static and not self.running and not self._batch_waiting():
            # static batching: the next batch is the first max_running requests in line
            self.static_batch = {r.request_id for r in self.waiting[:self.max_running]}

        def add(request: Request, n: int) -> None:
            start = request.num_computed
            batch.chunks.append(Chunk(request, request.tokens[start:start + n], start,
                                      list(request.block_table), request.is_decoding,
                                      start + n == request.num_tokens))

        for request in sorted(self.running, key=lambda r: not r.is_decoding):  # (stable)
            if budget == 0:
                break
            if request.state != RUNNING:  # preempted to make room for an earlier one
                continue
            n = min(request.num_uncomputed, budget)  # 1 for a decode
            if self._make_room(request, n, batch):
                add(request, n)
                budget -= n
        # new requests, unless this step preempted one (it would be admitted back at once)
        while (budget and not batch.preempted and self.waiting
               and self._admitting(self.waiting[0]) and len(self.running) < self.max_running):
            n = self._admit(self.waiting[0], budget)
            if n == 0:  # its blocks are not free: it stays first in line
                break
            add(self.waiting.pop(0), n)
            budget -= n
        self._record(batch)
        self.step_index += 1
        return batch

    def _admitting(self, request: Request) -> bool:
        """Whether ``request`` may join now. Continuous batching: at any step. Static batching
        (``static=True``, the baseline Orca replaced): only as a member of the batch formed
        when the last one was done (its prefills may take several steps of the token budget);
        nobody else joins until every member is done, so the slots of the requests that
        finish early stay empty."""
        return not self.static or request.request_id in self.static_batch

    def _batch_waiting(self) -> bool:
        """Whether a member of the static batch is still in line (not yet admitted, or
        preempted)."""
        return any(r.request_id in self.static_batch for r in self.waiting)

    def update(self, batch: Batch, next_tokens) -> None:
        """Take the step's sampled tokens, one per chunk that ``samples`` (in batch order):
        advance each request, name its newly full blocks, finish the ones that are done."""
        next_tokens = [int(t) for t in next_tokens]
        n_samples = sum(c.samples for c in batch.chunks)
        if len(next_tokens) != n_samples:
            raise ValueError(f"next_tokens has {len(next_tokens)} tokens for the batch's "
                             f"{n_samples} sampling chunks")
        sampled = iter(next_tokens)
        for chunk in batch.chunks:
            request = chunk.request
            if request.state != RUNNING or request.num_computed != chunk.start:
                raise ValueError(f"request {request.request_id!r} is not where batch "
                                 f"{batch.step} left it: update each batch once, in order")
            request.num_computed += chunk.num_tokens
            self._register_full_blocks(request)
            if chunk.samples:
                request.output.append(next(sampled))
                if len(request.output) >= request.max_new_tokens:
                    self._finish(request, batch.step)

    def _record(self, batch: Batch) -> None:
        self.history.append(StepRecord(
            batch.step,
            tuple((c.request_id, "decode" if c.is_decode else "prefill", c.num_tokens)
                  for c in batch.chunks),
            batch.num_prefill_tokens, batch.num_decode_tokens, tuple(batch.preempted),
            len(self.waiting), self.num_available_blocks()))
