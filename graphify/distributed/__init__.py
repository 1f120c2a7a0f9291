"""Tensor parallelism: the ranks of a process group agree, before a call, on the graph
they replay (`lockstep`, `agreement`), and their graphs go with the group."""
