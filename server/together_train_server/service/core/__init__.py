"""What every part of the service builds on: operation records, the operation book and the session queues
(`operations`: one trainer worker running operations in each session's seq_id order), and the session record
(`session_record`). Nothing here imports another room of service/."""
