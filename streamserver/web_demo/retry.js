// When to reconnect, and when a server is gone: shared by the student page and the dashboard.
// The load simulator's students follow the same rules (streamserver/loadsim/ws_student.py).
'use strict';

const RETRY_FIRST_S = 0.5;  // a break's first attempt comes within this
const RETRY_MAX_S = 10;     // the doubling window stops growing here
const HEARTBEAT_S = 2;      // no ack this long from a server whose acks came on time: it is gone
const SLOW_ACKS = 3;        // ... from one whose acks came late: this many times its longest recent gap
const SILENCE_S = 10;       // ... and never longer than this

// Seconds before reconnect attempt `attempt` (0: the first after a break): a random share of a
// window that doubles with each failed attempt, so that the students of a server that restarted
// come back spread out rather than in one wave; a server's Retry-After is a floor, spread over
// half as much again.
function reconnectWaitS(attempt, retryAfterS = 0) {
  if (retryAfterS > 0) return retryAfterS * (1 + Math.random() / 2);
  return Math.random() * Math.min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** attempt);
}

// A server acknowledges every 0.5 s. One that is merely slow (its event loop late under load)
// acks late, not never: the wait grows with the gaps it showed lately, so that a busy server is
// not left by all of its students at once (which makes it busier still). Only time the page was
// running counts: a background tab's timers are throttled, and its acks wait unread meanwhile.
const CHECK_SLACK_S = 0.7;  // the page checks every 0.5 s: a longer pause between two is its own
class AckWatch {
  constructor() { this.last = this.checked = performance.now(); this.gaps = []; }
  heard() {
    const now = performance.now();
    this.gaps.push((now - this.last) / 1000);
    if (this.gaps.length > 20) this.gaps.shift();
    this.last = now;
  }
  restart() { this.last = this.checked = performance.now(); }
  windowS() { return Math.min(SILENCE_S, Math.max(HEARTBEAT_S, SLOW_ACKS * Math.max(0, ...this.gaps))); }
  silent() {
    const now = performance.now();
    this.last += Math.max(0, now - this.checked - CHECK_SLACK_S * 1000);
    this.checked = now;
    return (now - this.last) / 1000 > this.windowS();
  }
}
