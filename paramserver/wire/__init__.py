"""What travels between processes: the message format and its bounds
(protocol, layouts, lanes), the ZeroMQ transport and CURVE keys.
"""
