"""Known crashes, each with one line saying what to change in the recipe.

A recipe that raises on every case usually raises one of a few exceptions whose text does not say what the battery
did differently from the user's own loop. :func:`hint` matches an exception's ``Type: message`` text against
:data:`HINTS` and returns the first hint that fits, or None.
"""

from __future__ import annotations

import re

HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Target -100 is out of bounds|IndexError: .*\b-100\b"),
     "the battery marks every unsupervised position with -100 (harness.IGNORE_INDEX): pass ignore_index=-100 to the "
     "loss, or map labels == -100 to your ignore index"),
    (re.compile(r"Expected to have finished reduction in the prior iteration"),
     "a parameter got no gradient in some window while DDP expected all of them: run with "
     "--find-unused-parameters on (DDP's find_unused_parameters=True), or make every parameter take part in the "
     "loss"),
    (re.compile(r"result type Float can't be cast to the desired output type Long|"
                r"ReduceOp\.AVG.*(?:Long|int64|integer)|(?:Long|int64|integer).*ReduceOp\.AVG"),
     "an integer count cannot be all-reduced with ReduceOp.AVG: all-reduce it with ReduceOp.SUM (the global count "
     "is a sum), or convert it to a float tensor first"),
    (re.compile(r"element \d+ of tensors does not require grad and does not have a grad_fn"),
     "backward() was called on a tensor outside autograd (a .detach(), .item() or torch.no_grad() on the loss's "
     "path): build the loss from the model's output"),
    (re.compile(r"Trying to backward through the graph a second time"),
     "a backward() reuses a graph already freed: run the model's forward again for each backward, or compute the "
     "window's loss once and call backward() once"),
    (re.compile(r"has no attribute '(?:inputs|labels|input_ids|attention_mask|position_ids)'|"
                r"KeyError: '(?:input_ids|labels|attention_mask|position_ids)'|"
                r"object is not subscriptable"),
     "the microbatch is not in the format the recipe reads: the battery hands a harness Microbatch by default; "
     "--batch-format hf (or packed) hands the dicts a Hugging Face loop sees"),
    (re.compile(r"Expected all tensors to be on the same device"),
     "a tensor the recipe made is on another device than the model: create it on the batch's or the model's device"),
)
"""Each known crash: the pattern its ``Type: message`` text matches, and what to change."""


def hint(exception: str) -> str | None:
    """What to change for the crash whose ``Type: message`` text is ``exception``, or None for an unknown one."""
    for pattern, said in HINTS:
        if pattern.search(exception):
            return said
    return None
