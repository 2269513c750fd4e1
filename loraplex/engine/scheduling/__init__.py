"""Who runs next: the scheduler seam and FIFO (`scheduler`), the policies by name (`schedulers`: sjf,
vtc, chameleon), Chameleon's queues, quotas and request sizes, and the output-length predictor."""
