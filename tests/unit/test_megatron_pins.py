"""Canary for the one megatron-core internal the checkpoint module sets (on CPU and GPU alike)."""


def test_torch_dist_results_queue_is_where_the_checkpoint_module_sets_it():
    import inspect
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from bapo_megatron.trainer.dist_ckpt import in_process_results_queue

    source = inspect.getsource(filesystem_async._get_write_results_queue)
    assert "global _results_queue" in source and "if _results_queue is None" in source
    assert "self.results_queue.get_nowait()" in inspect.getsource(filesystem_async.FileSystemWriterAsync)
    in_process_results_queue()
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
