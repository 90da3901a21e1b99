"""Generation: the partial-rollout buffer, the rollout core, its strategies (sync modes, async), held-out evaluation."""
