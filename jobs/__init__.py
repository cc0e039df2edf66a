"""Entry points, `python -m jobs.<name>`. Importing the package sets the job's environment (`jobs.env`)
before an entry point imports Ray, which reads part of it at import."""
from jobs.env import prepare_environment

prepare_environment()
