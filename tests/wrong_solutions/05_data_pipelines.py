"""Plausible wrong solutions of chapter 05's exercises (see harness.py)."""

WRONG = {
    "ex05_5_cuda_prefetcher": {
        "a synchronous loop: no side stream, nothing overlaps": '''
class CudaPrefetcher:
    def __init__(self, loader, device):
        self.loader = loader
        self.device = torch.device(device)
        self.uses_cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def __iter__(self):
        for b in self.loader:
            yield dp.to_device(b, self.device)
''',
    },
    "ex05_4_buffer_bytes": {
        "calls the reference": '''
def prefetch_buffer_bytes(batch_size, sample_bytes, prefetch_factor, num_workers):
    return dp.prefetch_buffer_bytes(batch_size, sample_bytes, prefetch_factor, num_workers)
''',
    },
}
