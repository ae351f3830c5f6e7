"""N-gram (prompt-lookup) drafts: the continuation of the context's last tokens where they
occurred before, on their own (`drafter`) or merged into another drafter's tree (`merged`)."""
