"""What drafter kinds share, so a new kind imports no other kind's private names:
`context` (a drafter's own KV cache over the committed context: the carry, writing rows,
fitting it to the attention window, the token after each entry), `tree_loop` (filling a
static tree depth by depth from a per-depth call of the kind's) and `backbone` (a handle on
the backbone: config, embedding, logits, rope, its decoder layer). docs/architecture.md's
drafter section describes the seam."""
