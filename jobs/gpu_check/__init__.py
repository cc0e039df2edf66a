"""The GPU check (`python -m jobs.gpu_check`): see __main__.py."""
