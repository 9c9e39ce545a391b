"""Where people decide approvals besides the API: a Slack app's buttons (`slack`, with its
request signatures in `slack_requests`) and one-time links for email or chat (`links`)."""
