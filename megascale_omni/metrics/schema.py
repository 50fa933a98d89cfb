"""The step record: every field a training step reports, its unit and meaning.

One record per committed optimizer step, written by the loss-owning rank of
each replica group to ``metrics.jsonl`` (one flat JSON object per line),
TensorBoard, the Prometheus endpoint and the control socket's ``metrics``.
Exporters and ``tools/report.py`` read field names from here, never from the
Trainer. Fields that do not apply (e.g. memory on a host without the
counter) are absent, never zero-filled.
"""

from __future__ import annotations

#: name -> (unit, meaning). Times are seconds of wall clock on the reporting
#: rank (forward/backward, its phases and the optimizer from the step's phase
#: clock: CUDA events on CUDA, docs/metrics.md); the breakdown fields sum to
#: ``step_s`` (``other_s`` is the remainder).
STEP_FIELDS: dict[str, tuple[str, str]] = {
    "step": ("", "committed optimizer steps so far (1 for the first step)"),
    "loss": ("", "token-mean loss over the global batch"),
    "lr": ("", "learning rate this step applied"),
    "grad_norm": ("", "global gradient norm before clipping"),
    "skipped": ("bool", "the optimizer skipped the update (inf/nan gradients)"),
    "loss_tokens": ("tokens", "tokens that carried loss in the global batch"),
    "tokens": ("tokens", "tokens in the global batch"),
    "samples": ("samples", "samples in the global batch"),
    "images": ("images", "images in the global batch (LLaVA, DiT)"),
    "microbatches": ("", "micro-batches this rank ran"),
    # modality mix (LLaVA, docs/video.md): a sample with a video counts as video, else by its images
    "samples_text": ("samples", "text-only samples in the global batch"),
    "samples_image": ("samples", "single-image samples in the global batch"),
    "samples_multi_image": ("samples", "samples with two or more images (interleaved) in the global batch"),
    "samples_video": ("samples", "samples with a video in the global batch"),
    "vision_tokens": ("tokens", "vision-tower tokens of the global batch (image views and video frames times "
                                "vision.tokens_per_image)"),
    "vision_deferred": ("samples", "samples the vision-token budget (data.max_vision_tokens_per_microbatch) "
                                   "moved from a fuller packed row to another in the global batch"),
    # MoE routing (docs/moe.md): over the step's training forwards, all micro-batches of the
    # job, each MoE layer in layer order
    "moe_expert_tokens": ("tokens", "per MoE layer, tokens routed to each expert after capacity dropping "
                                    "(list of lists; top-k: a token counts once per chosen expert)"),
    "moe_load_max": ("ratio", "per MoE layer, tokens of the busiest expert / mean tokens per expert "
                              "(1 = balanced; list)"),
    "moe_tokens_dropped": ("tokens", "per MoE layer, routing choices the expert capacity dropped (token x "
                                     "chosen expert; 0 when dropless; list)"),
    "moe_aux_loss": ("", "load-balancing loss without its coefficient, mean over MoE layers and micro-batches "
                         "(moe.load_balancing: aux_loss)"),
    "moe_z_loss": ("", "router z-loss without its coefficient, mean over MoE layers and micro-batches "
                       "(moe.z_loss_coeff > 0)"),
    # time
    "step_s": ("s", "wall time of the step"),
    "data_s": ("s", "waiting for this rank's micro-batches"),
    "compute_s": ("s", "forward and backward compute (fwd/bwd minus the waits below)"),
    "pipeline_wait_s": ("s", "blocked in pipeline send/receive (measured bubble + transfer)"),
    "moe_dispatch_s": ("s", "MoE token dispatch and combine (all-to-all or all-gather/reduce-scatter over the EP "
                            "group), forward and backward; 0 for a dense model"),
    "bubble_analytic": ("fraction", "1F1B bubble share (pp-1)/(m+pp-1) of the pipeline schedule"),
    "grad_sync_s": ("s", "gradient reduction inside the replica group (DP all-reduce, tied embeddings; "
                         "elastic: with the wait for the per-bucket cross-replica gradient sums)"),
    "cross_replica_s": ("s", "elastic: quorum wait, token-count and loss sums across replica groups, commit"),
    "optimizer_s": ("s", "optimizer step, grad-norm collectives included"),
    "metrics_s": ("s", "building and exporting the previous step's record, collecting the group's rank rows"),
    "checkpoint_s": ("s", "training blocked by a checkpoint at the step boundary"),
    "checkpoint_failed_saves": ("", "checkpoint saves abandoned so far by this process (no space, a rank's "
                                    "write or the commit failed; docs/checkpoints.md); absent without checkpoints"),
    "control_s": ("s", "the step boundary's exchanges: metrics (record, rank rows) and control commands"),
    "other_s": ("s", "step_s minus every component above"),
    "fwd_bwd_s": ("s", "compute_s + pipeline_wait_s + moe_dispatch_s + grad_sync_s + cross_replica_s"),
    # throughput and efficiency
    "tokens_per_s": ("tokens/s", "tokens / step_s"),
    "samples_per_s": ("samples/s", "samples / step_s"),
    "images_per_s": ("images/s", "images / step_s"),
    "model_tflop": ("TFLOP", "model FLOPs of the step's global batch (forward + backward, no recompute, causal LM "
                             "attention per packed sample; docs/metrics.md), whole job"),
    "vision_token_cost": ("", "LLaVA: model FLOPs of one vision-tower token over one LM token of this model "
                              "(the scheduler's weight of vision_tokens in a step's work; docs/scheduler.md)"),
    "tflops_per_device": ("TFLOP/s", "model_tflop / step_s / devices (all replica groups)"),
    "mfu": ("fraction", "tflops_per_device / dense bf16 peak TFLOP/s of one device (logging.peak_tflops, else "
                        "by exact CUDA device name)"),
    # memory (this rank)
    "mem_allocated_gib": ("GiB", "device memory held by tensors at the end of the step"),
    "mem_reserved_gib": ("GiB", "device memory held by the caching allocator"),
    "mem_peak_gib": ("GiB", "peak tensor memory during the step"),
    "mem_fragmentation": ("fraction", "1 - allocated / reserved: cached blocks not holding tensors"),
    "rss_gib": ("GiB", "resident host memory of the process"),
    "optimizer_state_bytes": ("bytes", "optimizer state this rank holds (Adam moments, fp32 main copies; "
                                       "its shard with parallel.use_distributed_optimizer)"),
    # replica group: every rank's RANK_FIELDS travel to every rank in the metrics exchange, which
    # completes during the next step, so these describe step ``group_step``, the previous one.
    # busy = data_s + compute_s: the time a rank is not waiting for others.
    "busy_s": ("s", "this rank's busy time, this step"),
    "group_step": ("", "the step the replica-group fields below describe"),
    "busy_s_median": ("s", "median busy time over the replica group's ranks"),
    "busy_s_max": ("s", "the slowest rank's busy time"),
    "slowest_rank": ("", "rank with the largest busy time"),
    "data_s_max": ("s", "longest data wait of any rank"),
    "compute_s_max": ("s", "longest compute of any rank"),
    "pipeline_wait_s_max": ("s", "longest pipeline wait of any rank"),
    "grad_sync_s_max": ("s", "longest gradient-sync wait of any rank"),
    "mem_peak_gib_max": ("GiB", "largest peak tensor memory of any rank (device)"),
    "rss_gib_max": ("GiB", "largest resident host memory of any rank (CPU)"),
    "straggler_count": ("", "ranks flagged slow"),
    "stragglers": ("", "ranks flagged slow (list)"),
    # elastic
    "participants": ("", "replica groups in the quorum"),
    "quorum": ("", "torchft quorum id of the step (increases within one lighthouse's life)"),
    "quorum_t": ("s", "wall time (time.time()) the lighthouse answered the step's quorum: which lighthouse "
                      "incarnation numbered it"),
    "healed": ("bool", "this group received state from a peer this step"),
    "cross_replica_bytes": ("bytes", "payload this rank handed to cross-replica all-reduces this step "
                                     "(gradients or their shard, token count, loss report)"),
    "cross_replica_early_buckets": ("", "gradient bucket groups whose cross-replica sum started during "
                                        "backward (parallel.overlap_grad_reduce)"),
}

#: Fields of its own step record every rank contributes to the replica
#: group's aggregate (:mod:`megascale_omni.metrics.replica_group`); absent
#: ones (memory counters of the other platform) travel as NaN.
RANK_FIELDS: tuple[str, ...] = ("busy_s", "data_s", "compute_s", "pipeline_wait_s", "grad_sync_s", "mem_peak_gib",
                                "rss_gib")
