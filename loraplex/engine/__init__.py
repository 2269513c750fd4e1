"""Torch-free engine policies and bookkeeping: requests, scheduler, pools, adapter residency and
the `schedule -> execute -> update` loop. Executors (torch or simulated) plug in behind `Executor`."""
