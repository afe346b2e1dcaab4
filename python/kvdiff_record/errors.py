"""RecorderError, the one error type of kvdiff_record (re-exported by
recorder.py and the package): its own module so that outfile.py and
recorder.py can both raise it without importing each other."""


class RecorderError(ValueError):
    """Bad input to the recorder (shape, position, dtype, config) or a file
    that cannot be written. The message names the layer, stage and positions."""
