"""Checkpoints, in one place: `layout` (where a checkpoint's files go, what makes a directory one), `manifest`
(each checkpoint's files' sizes and hashes, written as they are and verified before a load), `checks` (whole, of
this model, of this data order), `lines` (the line of training `checkpoints/` holds: the newest whole checkpoint,
what a new line or damage sets aside, pruning), `writing` (every checkpoint written under a temporary name and
renamed whole), the stores that write and read them (`store`: the interface and the one a run uses, chosen from
its strategy; `dcp_store`: DCP's, synchronous or in the background; `deepspeed_store`: DeepSpeed's own),
`resume` (where a run starts, decided once and carried to the ranks; checked, settled, restored) and
`python -m trainer.checkpoint verify` (`__main__`). Importing this package loads none of them."""
