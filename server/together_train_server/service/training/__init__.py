"""Training: operation records and the trainer worker (`operations`), submissions (`submissions`),
memory admission, and rank 0's guard over follower ranks (`rank_guard`)."""
