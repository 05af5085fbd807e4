"""The catalog of fixes: for every reading a diagnosis can name (:data:`harness.diagnosis.signature_catalog.SIGNATURES`,
the clipping readings beside it) and every check's failure, what to change in the recipe's code. Pure data.

Each fix is a template whose fields :func:`harness.diagnosis.fixes.fix_for` fills in the words of the run's strategy,
objective and mesh (a field never names a number the reading did not find):

``{right}``     the right normalization, whole: "divide each microbatch's loss sum by the window's supervised count,
                all-reduced over every data-parallel rank before the first backward, and multiply it by the world size"
``{term}``      what each microbatch contributes before the division ("loss sum", "weighted loss sum", ...)
``{count}``     the objective's normalizer ("the window's supervised count", "the declared constant normalizer", ...)
``{reduced}``   how the count is reduced (", all-reduced over the token group dp x cp (token_group(mesh))"; empty for
                a constant)
``{group}``     the group a count is reduced over ("every data-parallel rank", "the token group dp x cp, ...")
``{size}``      the factor that undoes the gradients' average ("the world size W", "the token group's size ...")
``{skip}``      how the strategy skips a synchronization ("model.no_sync()", "model.set_requires_gradient_sync(False)")
``{sync}``      how every microbatch but the last skips it and the last one synchronizes, in the strategy's words
``{found}``     what the reading found, named (a factor, the blocks, the other objective's option)
``{data}``      the group a per-microbatch term is averaged over ("every rank's microbatches", "data_group(mesh)'s")
"""

from __future__ import annotations

FIXES: dict[str, str] = {
    "correct": "nothing to change: the weighting is right",
    "float32_computation": "nothing to change in the weighting; keep the loss and its gradient in the model's dtype "
                           "(drop the .float() on the logits, the autocast region) for the float64 lane to pass, or, "
                           "where float32 is intended, judge the float32 lane alone (--precision fp32)",
    "global_scale": "{found}: {right}",
    "mean_of_local_means": "{right}; not by each rank's own count (a local mean, which the gradients' average over the "
                           "ranks turns into a mean of local means)",
    "per_microbatch_mean": "{right}; not by its own count, not by k",
    "weighted_by_real_tokens": "{right}; not each microbatch's mean weighted by its real (non-padding) tokens: an "
                               "attention mask's sum counts prompt tokens and each row's last position, which the "
                               "loss never supervises; count the labels that are not -100 after the shift",
    "per_sequence_mean": "{right}; not by each sequence's own length (a mean per sequence){found}",
    "per_pack_mean": "count the sequences of a packed row by seq_idx or position_ids' restarts, never the rows, and "
                     "{right}; not by a pack's own count",
    "shifted_across_boundaries": "shift the labels within each packed sequence: keep the separator (IGNORE_INDEX, "
                                 "-100, at every sequence's first position) and never rebuild the labels over the "
                                 "whole packed row, so that no sequence's last token is trained to predict the next "
                                 "sequence's first",
    "counted_across_boundaries": "count only the labels that are not -100 after the shift ((labels[:, 1:] != "
                                 "-100).sum() of the batch's own labels, the separator kept), never the packed rows' "
                                 "positions, which take each sequence's first position for a target; {right}",
    "shifted_and_counted_across_boundaries": "keep the batch's labels (-100 at every sequence's first position, "
                                             "the separator, and on the prompt) instead of rebuilding them over the "
                                             "whole packed row, so that no sequence's last token is trained to "
                                             "predict the next sequence's first, and count those labels that are "
                                             "not -100 after the shift: {right}",
    "prompt_supervised": "keep the batch's labels (-100 on the prompt and the padding) instead of rebuilding them from "
                         "input_ids, and count those labels: {right}",
    "dropped": "make every microbatch of every rank reach backward exactly once{found}: no early return or skipped "
               "backward on an empty microbatch or rank (backpropagate loss * 0 instead, so the synchronization still "
               "runs), no zero_grad after a backward",
    "double_counted": "backpropagate each microbatch once{found}: one backward per microbatch, no graph retained and "
                      "backpropagated again, no running total of losses backpropagated at every microbatch",
    "not_synchronized": "{sync}",
    "nonfinite": "never divide by a zero count: when {count} is 0, raise ValueError on every rank before any backward "
                 "(the contract's empty window), and let a rank or microbatch without a supervised token add a zero "
                 "loss sum (the global count is never zero then)",
    "weights_edited": "leave the weights alone in backward_window: move the in-place weight decay, optimizer step or "
                      "clamp into the training loop, after backward_window returns",
    "extra_term": "take the term out of the gradient backward_window leaves{found}, or declare it: an auxiliary loss "
                  "as the recipe's auxiliary_loss with its auxiliary_unit (docs/objectives.md), a regularizer or a "
                  "hook adding into .grad in the training loop after the gradient is taken",
    "packing_crosses_boundaries": "fix the model, not the recipe: make its packed forward a function of each "
                                  "sequence alone (positions from position_ids, attention masked block-diagonally per "
                                  "sequence: flash-attention varlen or a 4-D mask; use_cache=False on a transformers "
                                  "model)",
    "model_not_fixed": "fix the model, not the recipe: keep its forward a fixed function of its inputs (no buffer it "
                       "updates and reads in the same forward, no state carried between calls), or check it in eval "
                       "mode",
    "started_elsewhere": "nothing to change in this window: fix the earlier window whose step moved the weights (read "
                         "it: python -m harness explain --window J)",
    "fixed_accumulation_constant": "{right}; not by a fixed accumulation constant K (gradient_accumulation_steps) in "
                                   "place of the window's microbatch count{found}",
    "block_scaled": "take the count once per window, before its first microbatch, over every microbatch of the "
                    "window{found}, and {right}; not a count of one microbatch, not one left from an earlier window",
    "subgroup_count": "all-reduce the count over {group}, not over the ranks of one node (a LOCAL_WORLD_SIZE "
                      "sub-group): {right}",
    "other_objective": "{found}",
    "wrong_normalizer": "{right}; not by another all-reduced quantity",
    "per_rank_normalizer": "{right}; not by a normalizer of each rank's own (its batch's padded length, its row count)",
    "dynamic_microbatch_mean": "{right}, whatever micro-batches a token budget re-splits the window into (each "
                               "rank's own count of them, one synchronization on its last); not each micro-batch's "
                               "own mean divided by the rank's micro-batch count, which weighs a micro-batch of few "
                               "tokens like one of many and a rank of many micro-batches less (verl: "
                               "use_dynamic_bsz with loss_agg_mode=token-mean and the global token count)",
    "dynamic_microbatch_rows_share": "{right}, whatever micro-batches a token budget re-splits the window into; not "
                                     "each micro-batch's own token mean times its share of the rank's rows, which "
                                     "weighs a token of a micro-batch of short rows more than one of long rows (verl: "
                                     "use_dynamic_bsz with loss_agg_mode=token-mean and the global token count)",
    "constant_averaged_over_ranks": "multiply each rank's {term} over the declared constant by {size}, as the token "
                                    "mean's loss is: {right}; the gradients' average over the ranks divides by W, "
                                    "and a constant has no all-reduced count to cancel it (verl #5366's * dp_size)",
    "auxiliary_token_normalized": "average the auxiliary term over the window's microbatches: add aux / k on each "
                                  "rank ({data}), not aux times the main loss's factor ({size}) over its count",
    "auxiliary_divided_twice": "divide the auxiliary term by the microbatch count k once ({data}): aux / k, added "
                               "where the loss is, not divided again where it is summed",
    "auxiliary_summed_over_ranks": "average the auxiliary term over the ranks, do not sum it: add aux / k on each "
                                   "rank ({data}), without the main loss's factor ({size})",
    "auxiliary_misweighted": "weigh the auxiliary term by its unit's 1/D on every microbatch alike: a per-microbatch "
                             "term aux / k on each rank ({data}); a per-token term summed over the microbatch's "
                             "supervised tokens and divided like the main loss ({right})",
    "auxiliary_not_divided_by_k": "divide the per-microbatch auxiliary term by the accumulation steps: add aux / k "
                                  "to each microbatch's loss on each rank ({data}), never the whole aux on every "
                                  "microbatch",
    "auxiliary_divided_by_dp": "multiply each rank's share of the global auxiliary term by the data group's size: "
                               "all-reduce the assignment counts and the token count over the data ranks, and add "
                               "dp x (this microbatch's probabilities against the window's fractions) / N, so the "
                               "gradients' average over the data ranks sums the shares instead of averaging them "
                               "(harness.recipes.moe_terms:global_router_balance)",
    "auxiliary_divided_by_micro_batch_size": "sum the per-sequence auxiliary values over the microbatch's sequences, "
                                             "not their mean over its B rows, and divide by the window's count of "
                                             "sequences with a supervised token (all-reduced over the data ranks), "
                                             "times the data group's size: each sequence weighs 1/S "
                                             "(harness.recipes.moe_terms:sequence_router_balance)",
    "auxiliary_divided_by_tp": "scale the per-token auxiliary term by the microbatch's whole supervised count (every "
                               "tp rank's shard of the sequence), not the router's local count of one shard: "
                               "multiply the scale by the tp size (Megatron-LM PR #5047's tp_cp_group.size()), then "
                               "divide by the window's N as the main loss is "
                               "(harness.recipes.moe_terms:token_router_balance)",
    "auxiliary_not_divided_by_tokens": "divide the per-token auxiliary sum by the window's supervised count N, "
                                       "all-reduced before the first backward, as the main loss is: {right}",
    "per_shard_sequence_mean": "all-reduce each row's supervised count over the cp group (mesh[\"cp\"]) before the "
                               "first backward and divide each chunk's tokens of a sequence by that whole count, and "
                               "the sum of the sequences' means by the count of sequences with a supervised token "
                               "taken over the data-parallel group (harness.recipes.data_group(mesh)), each sequence "
                               "once, times the token group's size (harness.recipes.token_group_size(mesh)); "
                               "harness.recipes.mesh_objectives:mesh_sequence_mean does this",
    "labels_shifted_per_chunk": "shift the labels for next-token prediction once, on the whole sequence before it "
                                "is sharded over cp (the sequence-parallel splitter's or the collator's shift), and "
                                "take each cp rank's chunk of labels as aligned with its logits: never shift a "
                                "rank's chunk again (that drops its first target and moves every other one a "
                                "position ahead); then {right}",
    "count_group": "all-reduce the count over the token group, {group}, not over the group this reading names, and "
                   "multiply by {size}: {right}",
    "experts_scaled": "sum each expert parameter's gradient over the expert-data group (the ranks holding the same "
                      "experts: expert_data_group(mesh)) and divide it by the whole token group's size "
                      "(expert_divide_factor(mesh)), as the dense parameters' average does, not by the expert-data "
                      "group's own size: under FSDP2 set_gradient_divide_factor(W) with "
                      "set_force_sum_reduction_for_comms(True) on every expert module (torchtitan), under DeepSpeed "
                      "the fix of PR #6546; or leave the reduction to the harness (no reduces_experts)",
    "router_cut_off": "gather the routing gates (and anything the experts weigh their outputs by) with an autograd "
                      "collective, an all-to-all or an all-gather whose backward sums the gradient back to its owner "
                      "(on gloo over a subgroup not torch.distributed.nn.functional.all_gather, whose backward fails "
                      "there in torch 2.13), never a plain dist.all_gather into preallocated tensors, so the main "
                      "loss's gradient reaches the router",
    "not_reduced_over_group": "all-reduce the gradients of the replicated parameters this reading names over the "
                              "dimension it names (a hand-written tensor-parallel layer's norms, a mixture-of-experts "
                              "router and experts under sequence parallelism), or let DTensor (parallelize_module, "
                              "SequenceParallel, to_local(grad_placements=(Partial(),))) reduce them",
    "pp_scale_grads": "normalize the loss yourself and turn the schedule's own scaling off: {right}; under "
                      "scale_grads=True each step rescales the gradients the window's earlier steps left",
    "pp_last_step_only": "let every schedule step of the window add into .grad: no zero_grad between the steps of one "
                         "window (or one schedule step per window, every microbatch in one step()); {right}",
    "pp_divided_by_microbatches": "pass scale_grads=False to the schedule: a loss already divided by the global count "
                                  "is divided by the schedule's microbatch count M again under scale_grads=True",
    "pp_microbatch_means": "make the schedule's loss_fn return each schedule microbatch's loss sum divided by {count}"
                           "{reduced} before the schedule runs, times {size}, with scale_grads=False; not its own "
                           "mean over its microbatch",
    "smoothing_over_local_vocabulary": "divide the smoothing term's sum of -log p over the vocabulary by the whole "
                                       "vocabulary's size V (logits.shape[-1] of the DTensor), not the local "
                                       "shard's (logits.to_local().shape[-1], V/tp), or compute it as "
                                       "logsumexp(logits, -1) - logits.mean(-1) on the sharded logits under "
                                       "loss_parallel",
    "log_softmax_backward_dropped": "compute token log-probs with -cross_entropy(logits, labels, reduction=\"none\") "
                                    "under loss_parallel (or gather the full logits first: logits.full_tensor()), "
                                    "and an entropy or a smoothing term from logsumexp and softmax (logsumexp(z) - "
                                    "(softmax(z) * z).sum(-1)), never from log_softmax, whose backward loss_parallel "
                                    "replaces by the identity in torch 2.13 (pytorch #190746)",
    "unexplained": "read the per-parameter table: the tensors over tolerance show where the gradient goes wrong (a "
                   "tensor never synchronized, a term no re-weighting makes, a loss over other tokens); python -m "
                   "harness explain --per-sequence fits one weight per row; the right computation is to {right}",
    # Clipping (harness.diagnosis.clipping.CLIPPING_SIGNATURES).
    "clipping_not_applied": "clip on every rank, once, after the synchronization: torch.nn.utils.clip_grad_norm_("
                            "model.parameters(), max_norm) over every parameter together after the last backward, "
                            "and return the norm it returns",
    "clipped_by_wrong_norm": "clip by the global norm of the synchronized gradient: clip_grad_norm_(model.parameters(),"
                             " max_norm) after the last backward, not a norm taken before the synchronization or over "
                             "part of the gradient{found}",
    "clipped_per_tensor": "clip once over every parameter together: one clip_grad_norm_(model.parameters(), max_norm) "
                          "after the synchronization, not one per tensor",
}
"""Every reading's fix, as a template (the fields: the module's docstring)."""

NORM_FIXES: dict[str, str] = {
    "norm_reduced_again": "return the norm of the synchronized gradient as it is: every rank already holds the whole "
                          "gradient, so do not all-reduce its square again",
    "norm_over_replicas": "sum the squared shard norms over the shard group only (harness.recipes.shard_group(mesh)), "
                          "or return the norm clip_grad_norm_ returns",
    "norm_sum_of_tensor_norms": "return the global L2 norm clip_grad_norm_ returns (the square root of the sum of "
                                "every tensor's squared norm), not a sum of per-tensor norms",
    "norm_without_root": "take the square root of the summed squared norms (or return the norm clip_grad_norm_ "
                         "returns)",
    "norm_largest_tensor": "return the global L2 norm clip_grad_norm_ returns over every parameter together, not the "
                           "largest tensor's",
    "norm_last_tensor": "clip once over every parameter together and return that norm, not the last tensor's of a "
                        "loop over the tensors",
    "norm_l1": "return the L2 norm (clip_grad_norm_'s default norm_type=2.0), not an L1 norm",
    "norm_inf": "return the L2 norm (clip_grad_norm_'s default norm_type=2.0), not the largest component",
    "clip_before_scale": "clip after every division and multiplication of the gradient, after the synchronization, "
                         "and return that norm",
    "shard_norm": "return the norm clip_grad_norm_ returns over the DTensor gradients (the global one), not the norm "
                  "of grad.to_local()",
    "local_shard_norm_over_group": "return the norm clip_grad_norm_ returns, or sum the squares of each gradient's "
                                   "full_tensor(): the local shards' squares summed over a group miss other ranks' "
                                   "shards or count a replicated one twice",
    "pre_sync_norm": "take the norm after the last backward (after the synchronization), not before it",
}
"""The clipping check's fix per named norm (its verdict's ``finding``)."""

CHECK_FIXES: dict[str, str] = {
    "one_sync": "{sync}",
    "one_sync_pipeline": "run each schedule step once per microbatch group: one step() per schedule step, its shape "
                         "inference's backward not run again (torch's schedules reduce a data-parallel stage at the "
                         "end of every step)",
    "ranks_agree": "make every rank step on the same synchronized gradient: no rank-local change of .grad after the "
                   "synchronization (a clip by a rank's own norm, a rank-local scale), the same clip and the same "
                   "optimizer on every rank; on a mesh, reduce every replicated parameter's gradient over every "
                   "dimension",
    "logged_loss": "return the window's {objective} at the weights it started from, the same on every rank: the sum "
                   "of every microbatch's {term} divided by {count}{reduced} (the unscaled value, detached), or "
                   "return None (logging is optional)",
    "hygiene": "leave the model's mode, the global random generators and the gradients' dtype as they were: draw any "
               "randomness from a torch.Generator of the recipe's own, restore model.train() after an eval pass, and "
               "keep .grad in the model's dtype (no .to() of a gradient)",
    "weights_unchanged": "move the in-place weight decay, optimizer step or weight clamp out of backward_window into "
                         "the training loop, after backward_window returns",
    "empty_window": "when {count} is 0, raise ValueError on every rank before any backward: test the all-reduced "
                    "count first, and leave .grad and the weights as they were",
    "clipping": "return (loss, norm) with the norm clip_grad_norm_(model.parameters(), max_norm) returns, once, after "
                "the last backward: the global norm of the synchronized gradient before clipping",
    "clipping_no_norm": "return (loss, total_norm) from a clipping recipe, total_norm the value clip_grad_norm_ "
                        "returns",
    "bf16_computation": "keep the computation in float32 for the float32 lane (no autocast region, no "
                        ".to(torch.bfloat16)), or judge the bf16 lane (--precision bf16) where bf16 is intended",
    "parity": "read the diagnosis: python -m harness explain names the weights the gradient holds; the right "
              "computation is to {right}",
}
"""Each check's fix for a failing verdict that no reading names (keyed by check, or by the check's finding)."""


__all__ = ["CHECK_FIXES", "FIXES", "NORM_FIXES"]
