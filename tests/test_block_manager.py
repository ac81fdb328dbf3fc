"""Block manager and scheduler bookkeeping without a model: reference counts, prefix hashing,
eviction, budgets, chunking and preemption."""
from attention_nodes.block_manager import BlockManager
from attention_nodes.config import SchedulerConfig
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import Scheduler
from attention_nodes.sequence import Sequence


def seq(tokens: list[int], max_tokens: int = 4, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), max_tokens, 0)


def compute(bm: BlockManager, s: Sequence) -> None:
    """Pretend every token of s was computed."""
    bm.grow(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def test_prefix_sharing_reference_counts_and_revival():
    bm = BlockManager(10, 4)
    a = seq(list(range(10)))  # 2 full blocks + 2 tokens
    compute(bm, a)
    assert bm.num_free_blocks == 7 and len(bm.cached) == 2
    b = seq(list(range(8)) + [50, 51, 52])
    prefix = bm.match_prefix(b)
    assert prefix == a.block_table[:2]
    assert bm.blocks_needed(b, b.num_tokens, prefix) == 1  # only the third block is new
    bm.share_prefix(b, prefix)
    assert b.num_computed_tokens == 8 and [bm.blocks[i].ref_count for i in prefix] == [2, 2]
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8  # a's private third block only
    bm.free_sequence(b)
    assert bm.num_free_blocks == 10
    c = seq(list(range(9)))
    prefix = bm.match_prefix(c)  # freed blocks keep their hash until reused
    assert len(prefix) == 2 and bm.blocks_needed(c, 9, prefix) == 3  # two revived from the free list + one new
    bm.share_prefix(c, prefix)
    assert bm.num_free_blocks == 8


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(10, 4)
    a = seq(list(range(8)))
    compute(bm, a)
    assert len(bm.match_prefix(seq(list(range(8))))) == 1  # not 2: the last token needs its logits


def test_reused_blocks_leave_the_prefix_cache():
    bm = BlockManager(3, 4)
    a = seq(list(range(8)))
    compute(bm, a)
    bm.free_sequence(a)
    other = seq(list(range(100, 112)))
    bm.grow(other, 12)  # takes every block, evicting a's hashes
    assert bm.cached == {} and bm.match_prefix(seq(list(range(9)))) == []


def test_same_tokens_different_history_do_not_match():
    bm = BlockManager(10, 2)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a)
    assert bm.match_prefix(seq([9, 9, 3, 4, 5])) == []  # block [3, 4] after a different first block


def test_scheduler_budget_chunks_and_seq_cap():
    bm = BlockManager(100, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10), bm)
    for i, n in enumerate([7, 6, 3]):
        sch.add(seq(list(range(n)), rid=f"r{i}"))
    b = sch.schedule()
    assert [s.request_id for s in b.seqs] == ["r0", "r1"] and b.num_new_tokens == [7, 3] and b.sample == [True, False]
    sch.finish_computed(b)
    b.seqs[0].token_ids.append(99)
    b = sch.schedule()  # r0 decodes one token, r1 finishes its prompt; r2 waits for a sequence slot
    assert [s.request_id for s in b.seqs] == ["r0", "r1"] and b.num_new_tokens == [1, 3] and b.sample == [True, True]


def test_scheduler_preempts_the_newest_and_recomputes_it():
    bm = BlockManager(4, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    old, new = seq(list(range(8)), max_tokens=8, rid="old"), seq(list(range(20, 28)), max_tokens=8, rid="new")
    sch.add(old)
    sch.add(new)
    b = sch.schedule()
    assert b.num_new_tokens == [8, 8] and bm.num_free_blocks == 0
    sch.finish_computed(b)
    old.token_ids.append(1)
    new.token_ids.append(2)
    b = sch.schedule()  # old needs a third block: new is preempted and its blocks freed
    assert b.num_preempted == 1 and [s.request_id for s in b.seqs] == ["old"]
    assert new.num_computed_tokens == 0 and sch.waiting[0] is new and new.token_ids[-1] == 2
    sch.finish(old, "length")
    b = sch.schedule()
    # prompt and generated token are recomputed, except new's first block: still cached (its tail block
    # was freed first and reused by old, so it was evicted)
    assert b.seqs == [new] and b.num_new_tokens == [5] and new.num_computed_tokens == 4
