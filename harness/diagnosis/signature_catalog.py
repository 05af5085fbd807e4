"""The catalog of readings: each signature's name and what its weights look like, the names every diagnosis may give
(:mod:`harness.diagnosis.signatures` classifies fitted weights into them; the battery's own readings add theirs here, so
one list says what a diagnosis can name). Pure data."""

from __future__ import annotations

SIGNATURES: dict[str, str] = {
    "correct": "every token weighs 1/N: the global token mean",
    "float32_computation": "the weights are right, and the residual sits at float32 rounding scale in a float64 run",
    "global_scale": "every token weighs the same c/N with c != 1: a factor (world size, microbatch count) or a "
                    "normalizing count that is not the window's",
    "mean_of_local_means": "each rank's tokens weigh 1/(W * n_r): each rank divides by its own count",
    "per_microbatch_mean": "each microbatch's tokens weigh 1/(W * k * n_rm): a mean per microbatch",
    "weighted_by_real_tokens": "each microbatch's tokens weigh (r_m / n_m) / R: its mean over its supervised tokens "
                               "weighted by its real (non-padding) tokens r_m, prompt included, over the window's R",
    "per_sequence_mean": "each sequence's tokens weigh in inverse proportion to its own length: a mean per sequence",
    "per_pack_mean": "each packed row's tokens weigh 1/(n_r * P): a mean over the packs of a packed batch (several "
                     "sequences per row) taken for a mean over its sequences",
    "shifted_across_boundaries": "the weights are right, and the gradient also holds the loss of the pairs across "
                                 "packed sequences' boundaries (each sequence's last token trained to predict the next "
                                 "sequence's first): labels rebuilt over the whole packed row, the separator dropped",
    "counted_across_boundaries": "every token weighs 1/(N + B) (or 1/(N + P + B)): the batch's loss divided by a "
                                 "count of the packed rows' positions that takes each of the B sequence boundaries "
                                 "inside a row (a separator, -100 in the batch's labels; and the P prompt positions "
                                 "where named) for a target",
    "shifted_and_counted_across_boundaries": "the supervised tokens and the B pairs across packed sequences' "
                                             "boundaries all weigh 1/(N + B): labels rebuilt over the whole packed "
                                             "row, the separator dropped, and the loss divided by their own count",
    "prompt_supervised": "the blocks weigh alike, and the gradient also holds the loss of the prompt positions at the "
                         "same weight: labels rebuilt from the input ids, every real position supervised",
    "dropped": "some blocks weigh nothing (a rank or microbatch that never reached backward), the rest alike",
    "double_counted": "some blocks weigh twice what the others do (a microbatch backpropagated twice)",
    "not_synchronized": "a rank's gradient holds only its own microbatches (W times the right weight when its loss was "
                        "right): no synchronization",
    "nonfinite": "the gradient holds NaN or inf (a division by a zero count)",
    "weights_edited": "the recipe changed the weights inside backward_window (an in-place weight decay or step): the "
                      "gradient is taken at other weights than the reference's and is not read as a weighting",
    "extra_term": "the weights are right (or another signature's), and the gradient holds a term no re-weighting of "
                  "the losses makes: an auxiliary loss, a regularizer, a custom backward adding into .grad (its share "
                  "of the error and the tensors that carry it are named)",
    "packing_crosses_boundaries": "under --batch-format packed the model's packed forward is not its unpacked one: "
                                  "its attention crosses the sequences of a packed row (positions not taken from "
                                  "position_ids, no block-diagonal mask; a transformers model with use_cache on); "
                                  "a model fault, the recipe is not blamed",
    "model_not_fixed": "the block gradients recomputed at the rank's starting weights do not sum to the reference: the "
                       "model is not a fixed function of its inputs (a forward that reads a buffer it updates); the "
                       "recipe is not blamed",
    "started_elsewhere": "the window's weighting is right at the weights it started from, but an earlier window's step "
                         "moved them away from the reference's (read that window)",
    "fixed_accumulation_constant": "each microbatch divided by a fixed accumulation constant K instead of the window's "
                                   "microbatch count k (a per-microbatch mean times k/K, or every weight 1/K)",
    "block_scaled": "the blocks of one microbatch index (or one rank) off by a count's factor, every other block "
                    "right: a count taken for that microbatch alone (a stale or local count)",
    "subgroup_count": "each group of consecutive ranks' tokens weigh 1/N_g, its group's count: the count all-reduced "
                      "over a sub-group (the ranks of one node) instead of every data-parallel rank",
    "other_objective": "the gradient is exactly another declared objective's (the token mean judged under the "
                       "sequence mean, or the other way round): the recipe optimizes that objective, not the declared "
                       "one",
    "wrong_normalizer": "the objective's coefficients are right, and the whole window is divided by another "
                        "all-reduced quantity than the declared objective's (the supervised count where the weight sum "
                        "belongs)",
    "per_rank_normalizer": "each rank's tokens weigh their own factor: each rank divided by a normalizer of its own "
                           "(its local batch's padded length) instead of the constant the recipe declares",
    "dynamic_microbatch_mean": "each rank's rows fall in micro-batches of its own (a re-split by a token budget, "
                               "not the window's microbatches), and a token of micro-batch d weighs "
                               "1/(W * K_r * n_d): each micro-batch's token mean divided by the rank's micro-batch "
                               "count K_r (verl #3294, #4021)",
    "dynamic_microbatch_rows_share": "each rank's rows fall in micro-batches of its own (a re-split by a token "
                                     "budget), and a token of micro-batch d weighs B_d/(W * B_r * n_d): each "
                                     "micro-batch's token mean times its share of the rank's rows (verl's FSDP actor "
                                     "under use_dynamic_bsz: loss * micro-batch rows / ppo_mini_batch_size)",
    "constant_averaged_over_ranks": "under a constant normalizer C every token weighs 1/(W * C): the loss sum divided "
                                    "by the constant without the data-parallel factor, so the gradients' average "
                                    "over the W ranks divides it again (verl #3741, #5366)",
    "auxiliary_token_normalized": "the main loss's weights are right; the auxiliary term, one value per microbatch, "
                                  "was scaled by the main loss's token normalization (W/N) instead of averaged over "
                                  "the window's microbatches",
    "auxiliary_divided_twice": "the main loss's weights are right; the auxiliary term was divided by the microbatch "
                               "count twice",
    "auxiliary_summed_over_ranks": "the main loss's weights are right; the auxiliary term was summed over the ranks "
                                   "instead of averaged (the world-size factor of the main loss applied to it)",
    "auxiliary_misweighted": "the main loss's weights are right; the auxiliary term weighs another factor than its "
                             "unit's (named in the sentence)",
    "auxiliary_not_divided_by_k": "the main loss's weights are right; a per-microbatch auxiliary term weighs k times "
                                  "its unit's weight: added to every microbatch's loss and never divided by the "
                                  "accumulation steps (NeMo Automodel PR #3359)",
    "auxiliary_divided_by_dp": "the main loss's weights are right; a global auxiliary term (its router statistics "
                               "over the whole window) weighs 1/dp of its unit's weight: averaged over the data ranks "
                               "(Megatron-LM #3672, PR #3769)",
    "auxiliary_divided_by_micro_batch_size": "the main loss's weights are right; a per-sequence auxiliary term weighs "
                                             "1/B of its unit's weight in each microbatch of B rows: its sequences "
                                             "averaged where their sum belongs (Megatron-LM PR #5798)",
    "auxiliary_divided_by_tp": "the main loss's weights are right; a per-token or global auxiliary term weighs 1/tp of "
                               "its unit's weight under sequence parallelism: scaled by one tp rank's sequence shard's "
                               "token count (Megatron-LM PR #5047, #1652)",
    "auxiliary_not_divided_by_tokens": "the main loss's weights are right; a per-token auxiliary term weighs N times "
                                       "its unit's weight: never divided by the window's token total (verl #6609, "
                                       "PR #6836)",
    "count_group": "on a device mesh, each token rank's tokens weigh N/N_S, its group's count: the count was "
                   "all-reduced over a group S of the mesh's dimensions other than the token group (dp x cp): over dp "
                   "alone under cp, each shard's own, across tp ranks that hold the same tokens",
    "per_shard_sequence_mean": "under cp, each chunk's tokens of a sequence weigh 1/(S * n_chunk): every cp rank "
                               "divided its chunk of a sequence by the chunk's own count of its tokens, not the whole "
                               "sequence's (a per-shard sequence mean)",
    "labels_shifted_per_chunk": "under cp with a model that shards the sequence (Ulysses, a gathered attention), "
                                "every cp rank's labels shifted one more position within its chunk: each chunk's "
                                "first target dropped and every other position trained on the next one's target, "
                                "the token two ahead (labels shifted and sharded, then shifted again on each rank, "
                                "ms-swift PR #10185)",
    "not_reduced_over_group": "on a mesh, some tensors' synchronized gradients differ between ranks along one "
                              "dimension: replicated parameters never all-reduced over it (tp's norms; a "
                              "mixture-of-experts router and experts on each tp rank's sequence shard, torchtitan "
                              "#2387)",
    "pp_scale_grads": "scale_grads rescaled each pipeline step: step a of A weighs 1/M^(A-1-a), an exponential moving "
                      "average over the window's steps (torchtitan #1733)",
    "pp_last_step_only": "only the last pipeline step's gradient survived: every earlier step's blocks weigh 0",
    "pp_divided_by_microbatches": "a global-count loss under scale_grads=True: each step's blocks also divided by M",
    "pp_microbatch_means": "each pipeline schedule microbatch's own token mean over M x A (torchtitan #1732): a token "
                           "of schedule microbatch k weighs 1/(n_k M A T), a mean of the microbatches' means",
    "experts_scaled": "a mixture-of-experts model's expert parameters alone weigh a common factor (named: ep or "
                      "the token group's size W) while the dense tensors and the router are "
                      "right: the expert gradients' reduction divided by another number than the token group's size",
    "router_cut_off": "the gradient is the reference's with the routing gates detached: the gates reached the "
                      "experts without autograd, so the main loss never reached the router",
    "smoothing_over_local_vocabulary": "with the logits sharded over the vocabulary (tensor parallelism), the "
                                       "label-smoothing term weighs tp times too much: its mean of -log p over the "
                                       "vocabulary divided by the local shard's size V/tp, not V",
    "log_softmax_backward_dropped": "under loss_parallel, a log-prob, an entropy or a smoothing term computed from "
                                    "log_softmax on the vocab-sharded logits: torch 2.13 replaces log_softmax's "
                                    "backward by the identity there (pytorch #190746), so its gradient lacks the "
                                    "softmax part",
    "unexplained": "no catalog signature fits: a re-weighting of another shape, or (large residual) not a "
                   "re-weighting at all; the per-parameter table says where the error lives",
}
"""The catalog: each signature's name and what its weights look like (``ratio = weight / (1/N)``)."""


__all__ = ["SIGNATURES"]
