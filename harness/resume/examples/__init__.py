"""Two training loops written the way users write them, without the harness's helpers, each satisfying the trainer
contract: copy one and change it into yours. ``plain``: torch.save / torch.load; ``dcp``: torch.distributed.checkpoint
(the format FSDP users save in)."""
