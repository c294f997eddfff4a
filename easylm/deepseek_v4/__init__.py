"""DeepSeek-V4 (Pro, Flash): compressed sparse attention and hyper-connections."""
