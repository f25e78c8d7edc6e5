"""``hvd.elastic``: Horovod's elastic API on this runtime (filled by the elastic part).

It may import ``elastic.horovod``'s modules (not the package itself: that would be
an import cycle), the ``elastic`` API and the worker room.
"""
