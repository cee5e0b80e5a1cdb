"""Mutation check of the assignments: known wrong implementations must fail their task's grade.

    python tools/mutation_check.py                  # every mutation of every stage
    python tools/mutation_check.py --stage 07       # one stage's (repeatable)
    python tools/mutation_check.py --list           # the mutations, without running anything
    python tools/mutation_check.py --markdown       # the results as a table per stage
    python tools/mutation_check.py --list --markdown    # the table, without running anything
    python tools/mutation_check.py --order --stage 07   # tasks graded in their numbered order

A course grades a student's copy task by task (stages/grade.py). A grade is only worth something
if wrong code fails it, so this check plays the student who gets it wrong: for each mutation (a
plausible wrong implementation of one task function, written as a text patch of that function)
it writes the solution copy (`python -m stages assign NN DIR --solution`), patches it, grades the
task on the copy as `python -m stages grade DIR --quick --task N` does (the same worker, one per
stage, so torch loads once) and requires that task to FAIL. A mutation that passes is a hole: list
under the task every test that catches it (lesson.toml), or add a direct test.

The task is named by its function, not its number, so a manifest that reorders its tasks keeps
every mutation pointing at the right one. tests/test_mutations.py runs the `in_suite` ones.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import assign as assignments
from stages import grade as grading
from stages.lesson import find_function, load_lesson

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0  # per test phase: a mutation that hangs fails its test instead of the check


@dataclass(frozen=True, slots=True)
class Mutation:
    """One wrong implementation: `old` replaced by `new` inside the task function `function`."""

    stage: str
    function: str  # file.py::qualname, as the stage's lesson.toml names the task
    old: str  # occurs exactly once in the function's source
    new: str
    why: str  # the mistake, as a student would make it
    in_suite: bool = False  # caught by fast tests: tests/test_mutations.py runs it

    @property
    def task(self) -> int:
        """The task's number in today's manifest."""
        for number, task in assignments.numbered(load_lesson(self.stage)):
            if task.function == self.function:
                return number
        raise ValueError(f"stage {self.stage} has no task {self.function}")

    @property
    def label(self) -> str:
        return f"{self.stage} task {self.task} {self.function}: {self.why}"


M = Mutation
MUTATIONS: tuple[Mutation, ...] = (
    # ---------------------------------------------------------------------------------- 01
    M("01", "model.py::causal_attention", "* head_dim**-0.5  # [kv_heads", "# [kv_heads",
      "decode attention without the 1/sqrt(d) scale"),
    M("01", "sampling.py::apply_top_k_top_p", "sorted_logits < kth_largest",
      "sorted_logits <= kth_largest", "top-k drops the k-th largest too", in_suite=True),
    M("01", "sampling.py::sample", "torch.where(tensors.greedy, greedy_tokens, sampled)",
      "torch.where(tensors.greedy, sampled, greedy_tokens)",
      "greedy and sampled rows swapped in a mixed batch"),
    M("01", "kv_cache.py::ContiguousKVCache.store",
      "return self.k[layer, :end], self.v[layer, :end]",
      "return self.k[layer, start:end], self.v[layer, start:end]",
      "returns the new tokens' K/V only, not the whole context"),
    M("01", "sampling.py::_filtered_probs", "logits = logits.float() / tensors.temperature",
      "logits = logits.float() + 0 * tensors.temperature", "temperature ignored"),
    M("01", "scheduler.py::Scheduler.schedule", "if not self.running and self.waiting:",
      "if self.waiting:", "a second request admitted while one runs"),
    M("01", "request.py::Request.append_token", ">= (params.max_tokens or 0)",
      "> (params.max_tokens or 0)", "one token past max_tokens"),
    M("01", "request.py::Request.append_token",
      "not params.ignore_eos and token_id in self.eos_token_ids",
      "token_id in self.eos_token_ids", "EOS ends the request even with ignore_eos"),
    # ---------------------------------------------------------------------------------- 02
    M("02", "async_llm.py::AsyncLLM.generate", "                self.abort(request.request_id)",
      "                pass", "a client that goes away leaves its request running"),
    M("02", "async_llm.py::AsyncLLM._run", "                job.emit(error)\n",
      "                pass\n", "a dead engine leaves its clients waiting"),
    M("02", "async_llm.py::AsyncLLM.generate", "if request.request_id in self._active:",
      "if False:", "a second request under a running id is accepted (two consumers, one id)"),
    M("02", "async_llm.py::AsyncLLM._run", 'self.dead = f"{type(exc).__name__}: {exc}"',
      "pass", "the engine's failure not recorded: /health stays up, clients learn nothing"),
    # ---------------------------------------------------------------------------------- 03
    M("03", "block_pool.py::BlockAllocator.allocate", "block = self._free.popleft()",
      "block = self._free[0]", "hands out the same free block twice", in_suite=True),
    M("03", "kv_cache.py::KVCacheManager.allocate_slots", "if missing > self.allocator.num_free",
      "if missing >= self.allocator.num_free", "refuses when exactly enough blocks are free"),
    M("03", "kv_cache.py::slot_mapping", "block_ids[p // block_size] * block_size + p",
      "block_ids[p // block_size] + p", "block id used as a slot offset", in_suite=True),
    M("03", "kernels.py::unified_attention_reference", "v = v_cache[blocks",
      "v = k_cache[blocks", "values read from the key cache"),
    M("03", "scheduler.py::Scheduler._admit_static_batch", "            promised += worst\n",
      "", "every request checked against the whole free pool, none counted"),
    M("03", "model_runner.py::ModelRunner.prepare_inputs", "logits_rows.append(len(ids) - 1)",
      "logits_rows.append(len(ids) - r.num_new_tokens)",
      "samples from the first new token's logits, not the last's"),
    # ---------------------------------------------------------------------------------- 04
    M("05", "input_batch.py::InputBatch._write",
      "if len(table) >= len(held) and table[: len(held)] == held:", "if True:",
      "a replaced table (preempted, back with new blocks) only appended to: old blocks stay",
      in_suite=True),
    M("05", "input_batch.py::InputBatch._write", "            row[len(table) :] = 0\n", "",
      "a table written whole leaves the old row's blocks after it (not zero-padded)",
      in_suite=True),
    M("04", "scheduler.py::Scheduler._preempt", "victim.num_computed_tokens = 0",
      "victim.num_computed_tokens = victim.num_computed_tokens",
      "a preempted request keeps counting the KV it gave back"),
    M("04", "scheduler.py::Scheduler._preempt", "self.waiting.appendleft(victim)",
      "self.waiting.append(victim)", "a preempted request queued behind requests that never ran"),
    M("04", "scheduler.py::Scheduler._admit_waiting", "            budget -= num_new\n", "",
      "admission ignores the step's token budget"),
    M("04", "scheduler.py::Scheduler._schedule_running", "victim = self.running[-1]",
      "victim = self.running[0]", "the oldest request gives way (starvation-prone)"),
    # ---------------------------------------------------------------------------------- 05
    M("05", "model_runner.py::ModelRunner._forward_and_sample",
      "self._last_sampled[inputs.placeholder_sources]",
      "self._last_sampled[: len(inputs.placeholder_rows)]",
      "placeholders filled in the previous step's order, not by request"),
    M("05", "engine.py::LLMEngine.step",
      "self._idle = not scheduler_output.requests and self._in_flight is None",
      "self._idle = not scheduler_output.requests",
      "a step that only collects the one in flight counted as idle"),
    M("05", "scheduler.py::Scheduler._schedule_all_new_tokens",
      "end = known + request.num_output_placeholders", "end = known",
      "the token in flight is not scheduled"),
    M("05", "scheduler.py::Scheduler._schedule_all_new_tokens",
      "request.num_output_placeholders += 1", "request.num_output_placeholders += 0",
      "the token this step samples is not counted as in flight"),
    # ---------------------------------------------------------------------------------- 06
    M("06", "scheduler.py::Scheduler._chunk",
      "min(left, budget, cap) if cap else min(left, budget)",
      "min(left, cap) if cap else left", "a chunk ignores the step's token budget"),
    M("06", "scheduler.py::Scheduler._schedule_new_tokens",
      "sample = end == known + request.num_output_placeholders", "sample = True",
      "an intermediate prefill chunk samples a token"),
    M("06", "scheduler.py::Scheduler._chunk", "return left if left <= budget else 0",
      "return min(left, budget)", "without chunked prefill a prompt is cut to the budget anyway"),
    M("06", "scheduler.py::Scheduler._chunk",
      "min(left, budget, cap) if cap else min(left, budget)", "min(left, budget)",
      "the per-request threshold (long_prefill_token_threshold) ignored"),
    M("06", "scheduler.py::Scheduler._schedule_new_tokens",
      "request.num_output_placeholders += sample", "request.num_output_placeholders += 1",
      "an intermediate chunk counts a token in flight"),
    # ---------------------------------------------------------------------------------- 07
    M("07", "prefix_cache.py::block_content", 'hashlib.sha256(parent or b"\\x00")',
      'hashlib.sha256(b"\\x00")', "unchained key (parent kept beside it): hits lost",
      in_suite=True),
    M("07", "prefix_cache.py::block_content",
      'digest = hashlib.sha256(parent or b"\\x00")',
      'digest = hashlib.sha256(b"\\x00")\n    parent = None',
      "unchained key, parent not kept: a repeated block is served its parent's KV"),
    M("07", "block_pool.py::BlockAllocator.free", "    raise ValueError(f\"block {block} freed",
      "    continue  # (f\"block {block} freed", "no double-free check", in_suite=True),
    M("07", "block_pool.py::BlockAllocator.allocate", "self._free.popitem(last=False)",
      "self._free.popitem()", "hands out the most recently freed block (MRU, not LRU)"),
    M("07", "kv_cache.py::KVCacheManager.allocate_slots",
      "if missing + revived > self.allocator.num_free", "if missing > self.allocator.num_free",
      "a hit revived from the free queue not counted against the free blocks"),
    M("07", "kv_cache.py::KVCacheManager.find_cached_prefix",
      "limit = (request.num_tokens - 1) // self.block_size",
      "limit = request.num_tokens // self.block_size", "a hit may cover the last prompt token"),
    M("07", "kv_cache.py::KVCacheManager.cache_blocks",
      "min(num_computed_tokens, request.num_tokens)", "num_computed_tokens",
      "publishes a block whose last token is still in flight"),
    M("07", "scheduler.py::Scheduler._admit_waiting",
      "if request.num_cached_tokens is None:  # its first admission, not a recompute",
      "if True:", "hit statistics recorded again after a preemption"),
    # ---------------------------------------------------------------------------------- 08
    M("08", "spec_decode/drafters.py::NgramProposer._lookup",
      "range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1)",
      "range(self.min_n, min(self.max_n, len(tokens) - 1) + 1)",
      "the shortest matching n-gram first", in_suite=True),
    M("08", "spec_decode/drafters.py::NgramProposer._index",
      "latest[tuple(tokens[end - n : end])] = end - n",
      "latest.setdefault(tuple(tokens[end - n : end]), end - n)",
      "the oldest occurrence kept, not the most recent"),
    M("08", "spec_decode/drafters.py::DraftModelProposer.propose",
      "(q / race_exponentials(tensors.seeds, tensors.offsets, vocab)).argmax(-1)",
      "q.argmax(-1)", "argmax drafts reported with q (biased sampling)"),
    M("08", "spec_decode/rejection_sampler.py::rejection_sample_reference",
      "residual = (p - q).clamp_min_(0)", "residual = p.clone()",
      "a rejection resamples from p, not from the residual (p - q)+"),
    M("08", "scheduler.py::Scheduler._schedule_new_tokens",
      "request.spec_token_ids[:num_drafts]", "request.spec_token_ids[-num_drafts:]",
      "drafts taken from the wrong end (all of them when none fit)"),
    M("08", "scheduler.py::Scheduler.rollback",
      "        self.kv.trim(request.request_id, request.num_computed_tokens)\n", "",
      "rejected drafts keep their blocks"),
    M("08", "engine.py::LLMEngine.update_from_output",
      "self.spec_stats.record(drafts, accepted)", "self.spec_stats.record(drafts, len(tokens))",
      "the bonus token counted as an accepted draft"),
    M("08", "engine.py::LLMEngine.update_from_output",
      "                    if request.finished:  # a stop inside the accepted drafts ends it"
      " there\n                        break\n",
      "", "tokens after a stop inside the accepted drafts still appended"),
    M("08", "scheduler.py::Scheduler.rollback", "request.num_computed_tokens -= num_rejected",
      "request.num_computed_tokens -= max(0, num_rejected - 1)",
      "one rejected position too few rolled back"),
    # ---------------------------------------------------------------------------------- 09
    M("09", "parallel/group.py::kv_head_range", "head = rank * num_kv_heads // size",
      "head = rank % num_kv_heads",
      "replicated KV heads dealt round-robin, not to the ranks whose query heads read them"),
    M("09", "parallel/layers.py::QKVParallelLinear.weight_loader",
      "loaded, self.kv_heads.start * d, kv_rows)", "loaded, self.tp.rank * kv_rows, kv_rows)",
      "KV heads split by rank even when there are fewer than ranks (nano-vllm's assumption)"),
    M("09", "parallel/layers.py::RowParallelLinear.weight_loader", "if self.tp.rank == 0:",
      "if True:", "the bias loaded on every rank: the all-reduce adds it TP times"),
    M("09", "parallel/layers.py::VocabParallelEmbedding.forward",
      ".masked_fill_(~held.unsqueeze(-1), 0.0)", "",
      "ids another rank holds not zeroed: row 0 of every shard added in"),
    M("09", "parallel/multiproc_executor.py::MultiprocExecutor.launch",
      "if scheduler_output.requests:", "if True:", "an empty step shipped to every worker",
      in_suite=True),
    M("09", "parallel/worker.py::_serve",
      "runner.execute_model(*args)  # type: ignore[attr-defined]",
      'conn.send(("reply", runner.execute_model(*args)))  # type: ignore[attr-defined]',
      "every step answered: a message the engine never reads, per step", in_suite=True),
    M("09", "parallel/layers.py::QKVParallelLinear.weight_loader", "        d = self.head_dim\n",
      "        if param.dim() == 1:  # a bias\n            return\n        d = self.head_dim\n",
      "q/k/v biases never loaded (Qwen2-style checkpoints have them)", in_suite=True),
    M("09", "parallel/multiproc_executor.py::MultiprocExecutor.launch",
      "return _WatchedStep(step, self._step_result)", "return step",
      "rank 0's step not watched: a worker dead mid-step surfaces as gloo's error, unnamed",
      in_suite=True),
    M("09", "parallel/multiproc_executor.py::MultiprocExecutor.launch",
      "step = self._checked(lambda: self.driver.launch(scheduler_output))",
      "step = self.driver.launch(scheduler_output)",
      "launch unchecked: on CUDA (the collective runs inside launch) a dead peer is gloo's "
      "socket error, the rank unnamed (the first H100 run)", in_suite=True),
    M("09", "parallel/multiproc_executor.py::MultiprocExecutor.launch", "self._step_result)",
      "lambda step: step.result())",
      "rank 0's step waited for blindly (on NCCL for ever), the dead rank unnamed"),
    M("09", "parallel/worker.py::_serve",
      "            result = getattr(runner, name)(*call_args)\n"
      "            conn.send((\"reply\", result if method == \"call_all\" else name))",
      "            if method == \"call\":\n                conn.send((\"reply\", name))\n"
      "            result = getattr(runner, name)(*call_args)\n"
      "            if method == \"call_all\":\n                conn.send((\"reply\", result))",
      "a call acknowledged before it runs: an error on that rank never reaches the caller",
      in_suite=True),
    M("09", "parallel/worker.py::_serve", "result if method == \"call_all\" else name", "name",
      "call_all answered with the method's name, not its result", in_suite=True),
    # ---------------------------------------------------------------------------------- 10
    M("10", "frontend/router.py::Router.route", "        chosen.load += 1\n", "",
      "load never counted: every request goes to the same replica", in_suite=True),
    M("10", "frontend/router.py::Router._cache_aware", "target = _least_loaded(candidates)",
      "target = min(candidates, key=lambda r: (len(r.cached), r.index))",
      "a miss routed to the smallest cache (the death spiral)", in_suite=True),
    M("10", "frontend/router.py::Router.apply_events",
      "state.cached.discard(event.block_hash)", "pass",
      "evicted blocks stay in the router's view: it routes to caches that are gone"),
    M("10", "frontend/output_processor.py::OutputProcessor.process_outputs",
      "result.ids_to_abort.append(request.request_id)", "pass",
      "a stop string ends the request here but the core keeps generating it"),
    M("10", "frontend/engine_core.py::_busy_loop", "engine.abort_request(request_id)", "pass",
      "aborts ignored by the core: an abandoned request holds its blocks to the end"),
    # ---------------------------------------------------------------------------------- 11
    M("11", "moe/expert_parallel.py::expert_map",
      "mapping = torch.full((num_experts,), -1, dtype=torch.long)",
      "mapping = torch.full((num_experts,), -1, dtype=torch.int32)",
      "an int32 table where the contract says int64"),
    M("11", "moe/layer.py::route", "scores = torch.softmax(logits.float(), dim=-1)",
      "scores = torch.softmax(logits, dim=-1)", "the softmax in the logits' dtype, not fp32"),
    M("11", "moe/expert_parallel.py::dispatch", "remote = sum(send) - send[ep.rank]",
      "remote = sum(send)", "dispatch_bytes counts the rows a rank sends to itself"),
    M("11", "moe/expert_parallel.py::dispatch", "ep.stats.exchanges += 4",
      "ep.stats.exchanges += 1", "dispatch counts one exchange for its four"),
    M("11", "moe/expert_parallel.py::dispatch",
      "send, recv = torch.stack([send_counts, recv_counts]).tolist()",
      "send, recv = send_counts.tolist(), recv_counts.tolist()",
      "the split sizes read with two host syncs instead of one"),
    M("11", "moe/expert_parallel.py::combine",
      "ep.stats.combine_bytes += remote * results.shape[1] * results.element_size()",
      "ep.stats.combine_bytes += 0", "combine never counts its bytes"),
    M("11", "moe/expert_parallel.py::combine", "ep.stats.exchanges += 1",
      "ep.stats.exchanges += 0", "combine does not count its exchange"),
    M("11", "moe/expert_parallel.py::combine",
      "out = results.new_zeros(num_tokens, results.shape[1])",
      "out = torch.zeros(num_tokens, results.shape[1])",
      "the output allocated in fp32 on the CPU, whatever the results' dtype and device"),
    M("11", "moe/layer.py::SparseMoE._gather_scatter", "self.ep.stats.exchanges += 2",
      "self.ep.stats.exchanges += 0", "the all-gather path counts none of its 2 exchanges"),
    M("11", "moe/layer.py::SparseMoE._gather_scatter",
      "self.ep.stats.combine_bytes += (self.ep.size - 1) * chunk * row_bytes(partial)",
      "self.ep.stats.combine_bytes += 0", "the reduce-scatter's bytes never counted"),
    M("11", "moe/expert_parallel.py::expert_map", "= torch.arange(counts[rank])",
      "= torch.arange(start, start + counts[rank])",
      "global expert ids used as local indices: rank 1 indexes past its experts", in_suite=True),
    M("11", "moe/layer.py::route", "elif renormalize:", "else:",
      "always renormalised: Qwen3-MoE without norm_topk_prob gets the wrong weights",
      in_suite=True),
    M("11", "moe/expert_parallel.py::dispatch", ".repeat_interleave(k)[order]", ".repeat(k)[order]",
      "rows tiled, not interleaved: each pair carries another token's hidden state",
      in_suite=True),
    M("11", "moe/expert_parallel.py::combine", "out.index_add_(0, sent.token_index, back)",
      "out.index_copy_(0, sent.token_index, back)",
      "a token's k results overwrite each other instead of adding up", in_suite=True),
    M("11", "moe/layer.py::SparseMoE._gather_scatter", "weights.reshape(-1), keep)",
      "torch.ones_like(weights.reshape(-1)), keep)",
      "routing weights dropped on the gathered path: every chosen expert counts fully",
      in_suite=True),
    M("11", "moe/layer.py::SparseMoE._gather_scatter", "reduce_scatter_into(self.ep, out, partial)",
      "out.copy_(partial[self.ep.rank * chunk : (self.ep.rank + 1) * chunk])",
      "reduce-scatter skipped: each rank keeps only its own experts' share of its tokens",
      in_suite=True),
    # ---------------------------------------------------------------------------------- 12
    M("12", "offload/manager.py::LRUOffloadManager.prepare_store",
      "if block.ready and block.ref_count == 0 and key not in keep:",
      "if block.ref_count == 0 and key not in keep:",
      "evicts a host block whose store is still in flight"),
    M("12", "offload/copy_engine.py::CopyEngine._execute",
      "if isinstance(fence, threading.Event) and not fence.wait(WAIT_TIMEOUT_SECONDS):",
      "if False:", "copies without waiting for the compute before it (vLLM #45704)",
      in_suite=True),
    M("12", "offload/connector.py::OffloadingConnectorWorker.handle_preemptions",
      "self.engine.order_compute_after(self.engine.touching(write_blocks))", "pass",
      "the forward overwrites blocks a store still reads (vLLM PR #29870)"),
    M("12", "offload/connector.py::OffloadingConnectorScheduler.get_num_new_matched_tokens",
      'if swap.state == "storing":', "if False:",
      "a swapped-out request resumes before its store completed (vLLM #46014)"),
    M("12", "kv_connector/scheduler_side.py::ConnectorScheduling.update_connector_output",
      "if request_id in update.load_failed:", "if False:",
      "a failed load taken for a finished one: the request runs on KV that never arrived"),
    M("12", "offload/manager.py::LRUOffloadManager.prepare_store",
      "if block.ready and block.ref_count == 0 and key not in keep:",
      "if block.ready and block.ref_count == 0:",
      "evicts a held key the same call asks to store: that key is lost", in_suite=True),
    M("12", "offload/copy_engine.py::CopyEngine._execute",
      "            with torch.inference_mode():\n"
      "                copy_batch(plan_batch(todo), self.device, self.host, batch.keep_alive)",
      "            try:\n"
      "                with torch.inference_mode():\n"
      "                    copy_batch(plan_batch(todo), self.device, self.host, batch.keep_alive)\n"
      "            except Exception:\n"
      "                logger.exception('KV copy failed')",
      "a copy that raises is logged and swallowed: its batch reports success, nothing copied",
      in_suite=True),
    M("12", "kv_connector/scheduler_side.py::ConnectorScheduling.update_connector_output",
      "elif request.num_cached_tokens is None:  # its first admission, not a swap-in", "else:",
      "prefix-hit statistics recorded again at every swap-in (a swap-in is no first admission)"),
    # ---------------------------------------------------------------------------------- 13
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      "elif not record.in_flight and record.block_ids", "elif record.block_ids",
      "the lease frees blocks a send still reads (vLLM #21570)", in_suite=True),
    M("13", "disagg/transfer_sides.py::DecodeTransfers.recv_finished",
      "only the free waited\n            self._release(record)",
      "only the free waited\n            pass",
      "a receive that failed earlier never gives its blocks back once drained (a leak)"),
    M("13", "disagg/connector.py::PrefillConnector.request_finished",
      'if request.finish_reason not in ("stop", "length"):', "if False:",
      "an aborted prefill still holds its blocks under the lease (and hands back params)"),
    M("13", "disagg/connector.py::DecodeConnector.update_state_after_alloc",
      "first = request.num_computed_tokens // self.block_size", "first = 0",
      "receives the whole prompt, overwriting the blocks of the local prefix hit"),
    M("13", "disagg/connector.py::DecodeConnector.update_state_after_alloc",
      "self.stats.tokens_loaded += num_external_tokens",
      "self.stats.tokens_loaded += request.num_tokens",
      "counts the whole prompt as loaded (its last token is computed here)"),
    M("13", "disagg/connector.py::DecodeConnector.update_state_after_alloc",
      "self.stats.blocks_loaded += len(dst)", "self.stats.blocks_loaded += len(block_ids)",
      "counts the whole block table as loaded, not the blocks the transfer writes"),
    M("13", "disagg/connector.py::DecodeConnector.request_finished",
      "delay = rid in self.side.records  # a receive still writes its blocks", "delay = False",
      "frees an aborted request's blocks while its receive may still write them "
      "(SGLang PR #32564)"),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      "elif record.state is KVPoll.TRANSFERRING and (", "elif False and (",
      "the prefill side never times out a send: the record transfers, its blocks held, for ever",
      in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      'self._fail(record, now, "lease expired")',
      'self._move(record, KVPoll.FAILED, now, "lease expired")\n'
      "                self._release(record)",
      "a lease that expires frees the blocks without telling the decode side", in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts", "now > record.lease_until",
      "now - record.since > self.config.lease_seconds",
      "the lease counted from the record's last move, not from the hold", in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts", "now > record.lease_until",
      "now >= record.lease_until", "the lease ends one instant early (>= its end)",
      in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      "now - record.since > self.config.transfer_timeout_seconds",
      "now > record.lease_until + self.config.transfer_timeout_seconds - "
      "self.config.lease_seconds",
      "a send's deadline counted from the hold, not from when the send started",
      in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      "elif not record.in_flight and record.block_ids and now > record.lease_until",
      "elif record.state is KVPoll.WAITING_FOR_INPUT and now > record.lease_until",
      "the lease checked only once decode has met the request: blocks held before that leak",
      in_suite=True),
    M("13", "disagg/transfer_sides.py::PrefillTransfers.poll_timeouts",
      'self._fail(record, now, "send timed out")',
      'self._move(record, KVPoll.FAILED, now, "send timed out")\n'
      '                self._out.to_peer.append(PeerMessage("failed", record.request_id))',
      "a send that timed out is failed but never cancelled: the transport never drains it",
      in_suite=True),
    M("13", "disagg/connector.py::PrefillConnector.request_finished",
      'if request.finish_reason not in ("stop", "length"):',
      'if request.finish_reason in (None, "abort"):',
      "a request that finished with an error treated as computed KV (held, params handed out)",
      in_suite=True),
    M("13", "disagg/connector.py::DecodeConnector.request_finished",
      "            self.side.abort(rid, self.clock())\n"
      "            self._settle(self._collect())\n"
      "            delay = rid in self.side.records  # a receive still writes its blocks",
      "            delay = self.side.records[rid].state is KVPoll.TRANSFERRING\n"
      "            self.side.abort(rid, self.clock())\n"
      "            self._settle(self._collect())",
      "free-or-delay decided by the state (TRANSFERRING), not by what is in flight: an abort "
      "after a receive timed out frees blocks still written (SGLang PR #32564)", in_suite=True),
    # ---------------------------------------------------------------------------------- 14
    M("14", "quant/formats.py::quantize_int8", "codes = torch.round(w / scale[:, None])",
      "codes = torch.trunc(w / scale[:, None])",
      "codes truncated toward zero instead of rounded: errors up to a whole step", in_suite=True),
    M("14", "quant/formats.py::unpack_int4", "torch.stack((low, high), dim=-1)",
      "torch.stack((high, low), dim=-1)",
      "nibbles swapped: every pair of columns exchanges its weights", in_suite=True),
    M("14", "quant/formats.py::quantize_int4", "scale = (high - low).clamp(min=_EPS) / 15",
      "scale = (high - low).clamp(min=_EPS) / 16",
      "16 codes, so divide by 16: the group's maximum clips to code 15, a whole step off",
      in_suite=True),
    M("14", "quant/kv_cache.py::QuantizedPagedKVCache._write",
      "codes[blocks] = torch.where(grow[:, None, :, None], again, held)", "pass",
      "the scale grows but the codes already in the block keep the old scale's meaning",
      in_suite=True),
    M("14", "quant/kv_cache.py::QuantizedPagedKVCache.step_blocks",
      "return k.to(dtype), v.to(dtype), compact.to(block_tables.dtype)",
      "return k.to(dtype), v.to(dtype), block_tables",
      "the step's blocks packed into a small pool but the tables still number the whole pool",
      in_suite=True),
    M("14", "quant/formats.py::quantize_int8", "scale = amax.clamp(min=_EPS) / INT8_MAX",
      "scale = amax / INT8_MAX",
      "no epsilon clamp: an all-zero row gets scale 0 and codes 0 / 0 (NaN, cast to 0 by luck)",
      in_suite=True),
    M("14", "quant/formats.py::quantize_int4", "scale = (high - low).clamp(min=_EPS) / 15",
      "scale = (high - low) / 15",
      "no epsilon clamp: an all-zero or constant group gets scale 0 and codes 0 / 0",
      in_suite=True),
    M("14", "quant/kv_cache.py::QuantizedPagedKVCache._write",
      "token_amax = x.float().abs().amax(dim=-1)  # [tokens, heads]",
      "token_amax = x.float().abs().amax(dim=(-2, -1))[:, None].repeat(1, x.shape[1])",
      "one scale per block shared by the KV heads: a head 100x smaller loses its range",
      in_suite=True),
    M("14", "quant/kv_cache.py::QuantizedPagedKVCache.step_blocks",
      "return k.to(dtype), v.to(dtype), compact.to(block_tables.dtype)",
      "return k, v, compact.to(block_tables.dtype)",
      "dtype ignored: a bf16 model's attention gets fp32 K/V (mixed dtypes)", in_suite=True),
    # ---------------------------------------------------------------------------------- 15
    M("15", "observability/metrics.py::Histogram.observe",
      "for i in range(first, len(self.edges)):",
      "for i in range(first, min(first + 1, len(self.edges))):",
      "each value counted in its own bucket only: the buckets are no longer cumulative",
      in_suite=True),
    M("15", "observability/metrics.py::FrontendMetrics.observe",
      "for before, after in itertools.pairwise(times):",
      "for before, after in itertools.pairwise(times[1:]):",
      "the first gap dropped: one inter-token sample short per request", in_suite=True),
    M("15", "observability/metrics.py::engine_counters", '"prefix_hits": kv.stats.hit_tokens,',
      '"prefix_hits": kv.stats.requests,',
      "prefix hits counted in requests, not tokens: the hit rate means nothing"),
    M("15", "observability/live_view.py::_grid",
      "USED if ref else FREE if content is None else CACHED",
      "USED if ref else FREE",
      "a free block whose K/V still serve a hit drawn as free: the page hides the prefix cache",
      in_suite=True),
    M("15", "config.py::EngineConfig._apply_preset",
      'return preset_settings(name, torch.device(device_type(given.get("device")))) | given',
      'return given | preset_settings(name, torch.device(device_type(given.get("device"))))',
      "the preset overrides what the user set", in_suite=True),
    M("15", "config.py::EngineConfig._apply_preset",
      'torch.device(device_type(given.get("device")))',
      'torch.device(given.get("device") or "cpu")',
      "device=None taken as the CPU, not resolved as auto: a GPU machine gets the CPU preset"),
    M("15", "observability/metrics.py::engine_counters",
      '"kv_cache_usage": (blocks - kv.num_free_blocks) / blocks if blocks else 0.0,',
      '"kv_cache_usage": blocks - kv.num_free_blocks,',
      "KV usage in blocks, not a share of the pool: the gauge reads 40 for 40 blocks"),
    M("15", "observability/metrics.py::engine_counters",
      '"kv_cache_usage": (blocks - kv.num_free_blocks) / blocks if blocks else 0.0,',
      '"kv_cache_usage": kv.num_free_blocks / blocks if blocks else 0.0,',
      "KV usage as the free share: an idle engine reads full"),
    M("15", "observability/metrics.py::engine_counters",
      '"spec_drafts": spec.num_verifications,', '"spec_drafts": spec.num_draft_tokens,',
      "drafts counted in tokens, not verifications: the mean accepted length is off by k"),
    M("15", "observability/metrics.py::engine_counters",
      '"num_running": queues["running"],',
      '"num_running": queues["running"] + queues["waiting"],',
      "requests running counted with those waiting: the gauge never shows a queue"),
    M("15", "observability/metrics.py::engine_counters",
      '"num_preemptions": scheduler.num_preemptions,', "",
      "preemptions left out: /metrics never shows the engine thrashing"),
    M("15", "observability/metrics.py::FrontendMetrics.observe",
      "self.timed.discard(request.request_id)", "pass",
      "a finished request's id kept in `timed`: memory grows, and a reused id gets no TTFT"),
    M("15", "observability/metrics.py::FrontendMetrics.observe",
      "while len(self.traces) > TRACES_KEPT:", "while False:",
      "traces never trimmed to TRACES_KEPT: memory grows with every request"),
    M("15", "observability/metrics.py::FrontendMetrics.observe",
      'reason = request.finish_reason or "abort"', "reason = request.finish_reason",
      "a request without a finish reason counted under the key None, not as an abort"),
    M("15", "observability/metrics.py::FrontendMetrics.observe",
      "with self.lock:", "if True:",
      "the lock dropped: /metrics, rendering from another thread, reads half an update"),
    M("15", "cuda_graphs.py::GraphPlan.pad", "padded = dict(values)", "padded = values",
      "pads the caller's inputs in place: the eager path's lists change under it"),
)  # fmt: skip


def apply(mutation: Mutation, copy: Path) -> None:
    """Patch the task function of a stage copy; the snippet must occur once inside it."""
    file, _, qualname = mutation.function.partition("::")
    path = copy / file
    node = find_function(path, qualname)
    if node is None or node.end_lineno is None:
        raise ValueError(f"{path}: no function {qualname}")
    lines = path.read_text().splitlines(keepends=True)
    first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    body = "".join(lines[first : node.end_lineno])
    if body.count(mutation.old) != 1:
        found = body.count(mutation.old)
        raise ValueError(f"{mutation.label}: the snippet occurs {found} times in {qualname}")
    patched = body.replace(mutation.old, mutation.new)
    path.write_text("".join(lines[:first]) + patched + "".join(lines[node.end_lineno :]))


@dataclass(frozen=True, slots=True)
class Outcome:
    mutation: Mutation
    status: str  # the task's grade on the mutated copy: fail | pass | not graded | crash
    detail: tuple[str, ...]  # the graded tests: status, node id, first failure
    failed_by: tuple[str, ...] = ()  # the node ids of the task's tests that failed

    @property
    def caught(self) -> bool:
        """The grade does not pass it (a crash of the grading worker is no pass either, but
        the grader then reports no task at all: see the output)."""
        return self.status in ("fail", "crash")


def _run_each(jobs: list[grading.Job], timeout: float) -> list[grading.RunResult | str]:
    """The jobs' results from one worker; if a job kills the worker (a signal such as SIGFPE
    from a kernel fed nonsense), each job in a worker of its own, a crash as its last words."""
    try:
        return list(grading.run_jobs(jobs, timeout=timeout))
    except RuntimeError:
        pass
    results: list[grading.RunResult | str] = []
    for job in jobs:
        try:
            results += grading.run_jobs([job], timeout=timeout)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            results.append(f"the grading worker crashed ({first.removesuffix(':')})")
    return results


def check(
    mutations: Iterable[Mutation], workdir: Path, *, timeout: float = TIMEOUT
) -> list[Outcome]:
    """Grade each mutation's task on its own patched solution copy (--quick): one worker
    process per stage, one pytest session per mutation."""
    by_stage: dict[str, list[Mutation]] = {}
    for mutation in mutations:
        by_stage.setdefault(mutation.stage, []).append(mutation)
    outcomes = []
    for stage, group in sorted(by_stage.items()):
        lesson = load_lesson(stage)
        jobs = []
        for index, mutation in enumerate(group):
            copy = assignments.assign(stage, workdir / f"{stage}-{index}", solution=True)
            apply(mutation, copy)
            tests = lesson.tasks[mutation.task - 1].tests
            jobs.append(grading.Job(copy, tuple(tests), quick=True, cases="until-failure"))
        for mutation, result in zip(group, _run_each(jobs, timeout), strict=True):
            if isinstance(result, str):
                outcomes.append(Outcome(mutation, "crash", (result,)))
                continue
            graded = grading.task_tests(lesson.tasks[mutation.task - 1], result)
            detail, failed_by = [], []
            for test in graded:
                failed_by += [test.node_id] if test.status == "fail" else []
                failed = [c for c in test.cases if c.outcome in ("failed", "error")]
                why = f": {failed[0].message[:120]}" if failed else ""
                detail.append(f"{test.status:<7} {test.node_id}{why}")
            status = grading.task_status(graded)
            outcomes.append(Outcome(mutation, status, tuple(detail), tuple(failed_by)))
    return outcomes


def stage_test_files(stage: str) -> tuple[str, ...]:
    """The stage's own test files (tests/test_NN_*.py) and every file a task of it grades
    from: what the sweep runs on each mutated copy."""
    tests = ROOT / "tests"
    own = [f"tests/{p.name}" for p in sorted(tests.glob(f"test_{stage}_*.py"))]
    graded = [t.partition("::")[0] for task in load_lesson(stage).tasks for t in task.tests]
    return tuple(dict.fromkeys([*own, *graded]))


@dataclass(frozen=True, slots=True)
class SweepOutcome:
    """One mutation run against every test of its stage: which tests fail it, and which of
    those the task's grade does not hold (each belongs in it: a test that catches a task's
    bug is evidence about that task)."""

    mutation: Mutation
    failing: tuple[str, ...]  # node ids (without [param]) that failed on the mutated copy
    outside: tuple[str, ...]  # of those, the ones not in the task's grade
    crash: str = ""


def sweep(
    mutations: Iterable[Mutation], workdir: Path, *, timeout: float = TIMEOUT
) -> list[SweepOutcome]:
    """Check the task-to-test mapping by mutation: each mutated copy runs the stage's whole
    test files (--quick), not only its task's tests. A failing test outside the task's list
    is a test the manifest should grade that task with."""
    by_stage: dict[str, list[Mutation]] = {}
    for mutation in mutations:
        by_stage.setdefault(mutation.stage, []).append(mutation)
    outcomes = []
    for stage, group in sorted(by_stage.items()):
        lesson, files = load_lesson(stage), stage_test_files(stage)
        jobs = []
        for index, mutation in enumerate(group):
            copy = assignments.assign(stage, workdir / f"{stage}-sweep-{index}", solution=True)
            apply(mutation, copy)
            jobs.append(grading.Job(copy, files, quick=True, stage=stage))
        print(f"stage {stage}: {len(group)} mutations x {len(files)} test files", flush=True)
        for mutation, result in zip(group, _run_each(jobs, timeout), strict=True):
            if isinstance(result, str):
                outcomes.append(SweepOutcome(mutation, (), (), crash=result))
                continue
            failing = tuple(
                dict.fromkeys(
                    c.node_id.partition("[")[0]
                    for c in result.cases
                    if c.outcome in ("failed", "error")
                )
            )
            graded = set(lesson.tasks[mutation.task - 1].tests)
            outside = tuple(t for t in failing if t not in graded)
            outcomes.append(SweepOutcome(mutation, failing, outside))
            line = f"  {mutation.label}: {len(failing)} failing, {len(outside)} outside its grade"
            print(line + "".join(f"\n      outside: {t}" for t in outside), flush=True)
    return outcomes


def check_order(stage: str, workdir: Path, *, timeout: float = TIMEOUT) -> list[tuple[int, str]]:
    """Whether the tasks can be graded in their numbered order: for each task N, a copy with
    tasks 1..N solved and the rest blanked passes N's first test (its direct test, which must
    use only the tasks before it). Returns (N, status) per task; every status should be pass
    (a failure names the later tasks whose stubs it reached)."""
    lesson = load_lesson(stage)
    jobs = []
    for number, task in assignments.numbered(lesson):
        restored = range(1, number + 1)
        copy = assignments.assign(stage, workdir / f"{stage}-order-{number}", restored=restored)
        jobs.append(grading.Job(copy, (task.tests[0],), quick=True))
    statuses, results = [], _run_each(jobs, timeout)
    for (number, task), result in zip(assignments.numbered(lesson), results, strict=True):
        if isinstance(result, str):
            statuses.append((number, result))
            continue
        cases = result.cases_of(task.tests[0])
        status = grading.graded_status(cases)
        stubs = sorted({n for c in cases for n in c.stubs} | set(result.thread_stubs))
        later = f" (reached the stub of task {', '.join(map(str, stubs))})" if stubs else ""
        statuses.append((number, f"{status}{later}" if status == "fail" else status))
    return statuses


def markdown(mutations: Sequence[Mutation], outcomes: Sequence[Outcome] = ()) -> str:
    """A table per stage: each wrong implementation, the task it is of, and (after a run) that
    task's grade and the task's tests that failed it. docs/assignments.md holds the last run's."""
    graded = {o.mutation: o for o in outcomes}
    out = []
    for stage in sorted({m.stage for m in mutations}):
        group = sorted((m for m in mutations if m.stage == stage), key=lambda m: m.task)
        head = f"### Stage {stage}, {load_lesson(stage).title.lower()}: {len(group)} wrong "
        head += "implementations"
        if graded:
            caught = sum(graded[m].caught for m in group if m in graded)
            head += f", {caught} fail their task"
        out += [head, ""]
        columns = ["task", "function", "wrong implementation"]
        columns += ["grade of the task", "failed by"] if graded else []
        out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for m in group:
            row = [str(m.task), f"`{m.function}`", m.why.replace("|", "/")]
            if m in graded:
                outcome = graded[m]
                names = [f"`{t.partition('::')[2]}`" for t in outcome.failed_by]
                verdict = outcome.status if outcome.caught else f"**{outcome.status}: MISSED**"
                row += [verdict, ", ".join(names) or "; ".join(outcome.detail)]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def add_to_grades(outcomes: Sequence[SweepOutcome]) -> dict[str, int]:
    """Append each outside test to its mutation's task in the stage's lesson.toml (the test
    caught that task's bug, so it grades that task). Returns tests added per stage."""
    added: dict[str, int] = {}
    for outcome in outcomes:
        mutation = outcome.mutation
        path = load_lesson(mutation.stage).path / "lesson.toml"
        text = path.read_text()
        start = text.index(f'function = "{mutation.function}"')
        begin = text.index("tests = [", start) + len("tests = [")
        end = text.index("]", begin)  # this task's own list: node ids hold no "]"
        listed = re.findall(r'"([^"]+)"', text[begin:end])
        new = [t for t in dict.fromkeys(outcome.outside) if t not in listed]
        if new:
            body = "".join(f'\n    "{t}",' for t in [*listed, *new]) + "\n"
            path.write_text(text[:begin] + body + text[end:])
            added[mutation.stage] = added.get(mutation.stage, 0) + len(new)
    return added


def sweep_markdown(outcomes: Sequence[SweepOutcome]) -> str:
    """The sweep as a table: each mutation, how many of its stage's tests fail it, and the
    ones outside its task's grade (none: the mapping holds for it)."""
    out = ["| stage | task | wrong implementation | tests failing | outside the task's grade |"]
    out.append("|---|---|---|---|---|")
    for o in outcomes:
        m = o.mutation
        outside = ", ".join(f"`{t}`" for t in o.outside) or ("crash" if o.crash else "none")
        row = [m.stage, str(m.task), m.why.replace("|", "/"), str(len(o.failing)), outside]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--stage", action="append", default=[], help="NN (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    parser.add_argument("--markdown", action="store_true", help="print a table per stage")
    parser.add_argument("-k", "--match", default="", help="only mutations whose label has this")
    parser.add_argument("--in-suite", action="store_true", help="only those the suite runs")
    parser.add_argument(
        "--order", action="store_true", help="check instead that tasks grade in their order"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="run each mutation against the stage's whole test files: list the tests that "
        "catch it outside its task's grade",
    )
    parser.add_argument(
        "--apply", action="store_true", help="with --sweep: add the outside tests to the grades"
    )
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per test phase")
    args = parser.parse_args(argv)
    wanted = {f"{int(s):02d}" for s in args.stage}
    chosen = [
        m
        for m in MUTATIONS
        if (not wanted or m.stage in wanted)
        and (m.in_suite or not args.in_suite)
        and args.match in m.label
    ]
    if args.list:
        print(markdown(chosen) if args.markdown else "\n".join(m.label for m in chosen))
        return 0
    if args.order:
        failed = 0
        with tempfile.TemporaryDirectory(prefix="order-check-") as tmp:
            for stage in sorted(wanted or {m.stage for m in MUTATIONS}):
                for number, status in check_order(stage, Path(tmp), timeout=args.timeout):
                    failed += not status.startswith("pass")
                    print(f"stage {stage} tasks 1..{number} solved: task {number} {status}")
        return 1 if failed else 0
    if args.sweep:
        with tempfile.TemporaryDirectory(prefix="mutation-sweep-") as tmp:
            swept = sweep(chosen, Path(tmp), timeout=args.timeout)
        print(sweep_markdown(swept))
        if args.apply:
            print(f"added to the tasks' grades, per stage: {add_to_grades(swept)}")
            return 1 if any(o.crash for o in swept) else 0
        return 1 if any(o.outside or o.crash for o in swept) else 0
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        outcomes = check(chosen, Path(tmp), timeout=args.timeout)
    for outcome in [] if args.markdown else outcomes:
        verdict = "caught " if outcome.caught else "MISSED "
        print(f"{verdict} {outcome.mutation.label} -> task {outcome.status}")
        print("".join(f"          {line}\n" for line in outcome.detail), end="")
    print(markdown(chosen, outcomes) if args.markdown else "", end="")
    missed = sum(not o.caught for o in outcomes)
    print(f"{len(outcomes) - missed} of {len(outcomes)} wrong implementations fail their task")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
