"""Rewards: built-in and user functions (functions.py), scored in bounded worker processes (workers.py)."""
