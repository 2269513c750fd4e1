"""What a request produces: sampling parameters, stopping, prompt logprobs and the JSON-mode grammar."""
