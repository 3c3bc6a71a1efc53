"""One module per collective algorithm, all written over hpdl.comm.transport."""
