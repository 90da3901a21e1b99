"""Generation: engines, partial-rollout buffer, rewards, data; and the rollout batch format."""
