"""The bottom layer every side of trainjob stands on: the trainer (its driver and its ranks), the launchers and
the data cache import these modules, and these import nothing of theirs (nor torch, but in the runtimes' node
agents, which nothing imports), so that neither side needs the other to read a run's files or a command line.

files        writing a file whole or not at all; whether a directory can be made and written at a path
cli          the one-line command-line parser every `python -m ...` command uses
env          the environment-variable names and exit codes the processes of a run pass each other
nodes        this machine as a node: `runtime.nnodes` (N, or MIN:MAX) as the fewest and most nodes, a free port,
             its GPUs (`nvidia-smi -L`, honouring CUDA_VISIBLE_DEVICES)
run_files    a run directory's files: their paths, and the readers and writers of metrics.jsonl,
             events.jsonl and summary.json
lazy         a package face whose names load on first use (launchers', datacache's, ops')
options      `OptionError`, what a launcher's or a runtime's own rules raise
process_tree every process started ends before the one that started it; a process's descendants
runtimes     Kubeflow's runtimes, one unit each, with their node agents beside them
"""
