"""Pure-Python core types: configs, requests, the step plan and result, errors."""
