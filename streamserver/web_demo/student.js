// Student page: microphone -> WebRTC (aiortc server) -> transcripts on the teacher's dashboard.
//
// The page also keeps the last KEEP_S of its microphone audio (16 kHz, on its own clock: seconds
// since it started recording) and learns over a "recovery" data channel how far the server has
// it safe (acks, also the heartbeat). After any break (the network, the server) it sends the rest
// again on the new connection, before the new live audio: streamserver/transport/recovery.py.
'use strict';

const ICE_GATHER_TIMEOUT_MS = 3000; // aiortc does no trickle ICE: we send the offer once gathering ends
const CONNECT_TIMEOUT_MS = 15000;   // answer applied but ICE never connects: start over
const DISCONNECT_GRACE_MS = 2000;   // 'disconnected' often heals by itself within a second or two
const KEEP_S = 60;            // microphone audio kept for sending again
const RATE = 16000;
// "my newest sample is at t": the first ones place the live audio on our clock, later ones only
// keep the server's estimate of our clock fresh (every message costs the server in Python)
const MARK_EVERY_MS = 250;
const MARKS_FAST = 8;
const MARK_LATER_MS = 5000;
const ENDED_REPLACED = 4001;    // "ended" on the recovery channel: connected again elsewhere
const ENDED_ROOM_CLOSED = 4003; // ... or the room was closed (the WebSocket ingest's close codes)
const CATCH_UP_RATE = 1.25;   // x real time; the server accepts up to 1.5x
const CATCH_UP_PIECE_S = 0.1;
const AUDIO_CONSTRAINTS = { echoCancellation: true, noiseSuppression: true, autoGainControl: true };

// The link carries room and token in its fragment (#room=…&token=…), which the browser never
// sends to a server (no Referer, no access log); links of older servers had them in the query.
const fragment = new URLSearchParams(location.hash.slice(1));
const query = new URLSearchParams(location.search);
const param = (key) => fragment.get(key) ?? query.get(key);
const room = param('room');
const token = param('token');

const $ = (id) => document.getElementById(id);
const form = $('join-form');
const nameInput = $('name');
const joinButton = $('join');
const leaveButton = $('leave');
const statusEl = $('status');
const levelEl = $('level');
const levelBar = levelEl.querySelector('.level-bar');

// One join = one session. The microphone stream and student_id outlive the peer connections:
// a reconnect builds a new RTCPeerConnection around the same track.
let session = null;

function setStatus(text, state) {
  statusEl.textContent = text;
  statusEl.dataset.state = state;
}

// The server issues the student_id with a resume secret that proves it on a reconnect. Both
// live in sessionStorage per room, so a reload or reconnect keeps the student's identity on
// the teacher's dashboard while a new tab is a new student.
const idKey = `streamserver:identity:${room}`;

function savedIdentity() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(idKey) || 'null');
    return saved && typeof saved.student_id === 'string' && typeof saved.resume === 'string' ? saved : null;
  } catch (err) {
    return null;
  }
}

// --- microphone level meter --------------------------------------------------------------

function startMeter(s) {
  const analyser = s.audioCtx.createAnalyser();
  analyser.fftSize = 1024;
  // Analyser only, never connected to the speakers: the student must not hear themselves.
  s.audioCtx.createMediaStreamSource(s.stream).connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  let shown = 0;

  const draw = () => {
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const v of samples) sum += v * v;
    const rms = Math.sqrt(sum / samples.length);
    // Map -60..0 dBFS to 0..1: speech sits around -30..-10 dBFS, where a linear bar barely moves.
    const target = Math.min(1, Math.max(0, (20 * Math.log10(rms + 1e-9) + 60) / 60));
    // Fast attack, slow release, so the bar reads like a VU meter instead of flickering.
    shown = target > shown ? target : shown * 0.9 + target * 0.1;
    const pct = Math.round(shown * 100);
    levelBar.style.width = `${pct}%`;
    if (levelEl.getAttribute('aria-valuenow') !== String(pct)) levelEl.setAttribute('aria-valuenow', pct);
    s.meterFrame = requestAnimationFrame(draw);
  };
  draw();
}

function resetMeter() {
  levelBar.style.width = '0%';
  levelEl.setAttribute('aria-valuenow', 0);
}

// --- the audio the page keeps ---------------------------------------------------------------

class KeptAudio {
  constructor() {
    this.buf = new Int16Array(KEEP_S * RATE);
    this.written = 0; // samples since recording started: the stream clock is written / RATE
    // This clock's name: a reload or a new join starts another clock at 0, which the server must
    // not take for the same speech as the old one's.
    this.clock = [...crypto.getRandomValues(new Uint8Array(8))].map((b) => b.toString(16).padStart(2, '0')).join('');
  }
  push(samples) {
    const n = this.buf.length;
    for (let i = 0; i < samples.length; i++) {
      const v = Math.max(-1, Math.min(1, samples[i]));
      this.buf[(this.written + i) % n] = Math.round(v * 32767);
    }
    this.written += samples.length;
  }
  get now() { return this.written / RATE; }
  get oldest() { return Math.max(0, this.written - this.buf.length) / RATE; }
  // PCM16 of stream times [from, to), as far as it is still kept
  slice(from, to) {
    const first = Math.max(Math.round(from * RATE), this.written - this.buf.length);
    const last = Math.min(Math.round(to * RATE), this.written);
    const out = new Int16Array(Math.max(0, last - first));
    for (let i = 0; i < out.length; i++) out[i] = this.buf[(first + i) % this.buf.length];
    return out;
  }
}

async function startKeeping(s) {
  await s.audioCtx.audioWorklet.addModule('/static/keeper-worklet.js'); // 16 kHz pieces of the microphone
  const node = new AudioWorkletNode(s.audioCtx, 'keeper');
  node.port.onmessage = (e) => s.kept.push(e.data);
  const mute = s.audioCtx.createGain(); // pulled by the destination, heard by no one
  mute.gain.value = 0;
  s.audioCtx.createMediaStreamSource(s.stream).connect(node).connect(mute).connect(s.audioCtx.destination);
  s.keeper = node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function onRecoveryMessage(s, pc, channel, data, stale) {
  let msg;
  try { msg = JSON.parse(data); } catch (err) { return; }
  if (msg.type === 'ack') s.acks.heard();
  if (msg.type === 'ack' && typeof msg.t === 'number') {
    s.ackT = Math.max(s.ackT ?? 0, msg.t);
  } else if (msg.type === 'live_from' && s.catchUpFrom !== null && !s.catchingUp) {
    sendCatchUp(s, channel, s.catchUpFrom, msg.t, stale);
  } else if (msg.type === 'error') {
    console.warn('recovery channel:', msg.error);
  } else if (msg.type === 'ended' && msg.code === ENDED_REPLACED) {
    // Reconnecting would take the seat back from the other tab, and it from this one, and so on.
    stop(s, 'You joined this class again in another tab or window, so this one has stopped. Press Join to speak from here instead.', 'error');
  } else if (msg.type === 'ended' && msg.code === ENDED_ROOM_CLOSED) {
    stop(s, 'The teacher has closed this class.', 'error');
  }
}

// What the server had not acknowledged when the last connection broke, up to where this
// connection's live audio starts, paced under the server's limit.
async function sendCatchUp(s, channel, from, to, stale) {
  s.catchingUp = true;
  const start = Math.max(from, s.kept.oldest);
  const gone = start > from ? ` (the first ${Math.round(start - from)} s were no longer kept)` : '';
  if (gone) console.warn(`catch-up${gone}`);
  try {
    channel.send(JSON.stringify({ type: 'catchup', from: start }));
    const began = performance.now();
    for (let t = start; t < to && !stale() && channel.readyState === 'open';) {
      const end = Math.min(to, t + CATCH_UP_PIECE_S);
      channel.send(s.kept.slice(t, end).buffer);
      t = end;
      setStatus(`connected — sending what you said while offline (${Math.ceil(to - t)} s left)${gone}`, 'connected');
      const ahead = (t - start) / CATCH_UP_RATE - (performance.now() - began) / 1000;
      if (ahead > 0) await sleep(ahead * 1000);
    }
    if (!stale() && channel.readyState === 'open') {
      channel.send(JSON.stringify({ type: 'caught_up' }));
      s.catchUpFrom = null;
      setStatus('connected — speak', 'connected');
    }
  } catch (err) {
    console.warn('catch-up interrupted:', err); // the next connection sends it again
  } finally {
    s.catchingUp = false;
  }
}

function openRecovery(s, pc, stale) {
  const channel = pc.createDataChannel('recovery', { ordered: true });
  channel.binaryType = 'arraybuffer';
  s.channel = channel;
  channel.addEventListener('open', () => {
    s.acks = new AckWatch();
    let marks = 0;
    const mark = () => {
      if (stale() || channel.readyState !== 'open') return;
      channel.send(JSON.stringify({ type: 'mark', t: s.kept.now }));
      s.markTimer = setTimeout(mark, ++marks < MARKS_FAST ? MARK_EVERY_MS : MARK_LATER_MS);
    };
    mark();
    if (stale()) return;
    s.heartbeatTimer = setInterval(() => {
      if (!stale() && s.serverKeeps && s.acks.silent()) retry(s, 'the server stopped answering');
    }, 500);
  });
  channel.addEventListener('message', (e) => { if (!stale()) onRecoveryMessage(s, pc, channel, e.data, stale); });
}

// --- WebRTC ------------------------------------------------------------------------------

// Asked again for every connection: a TURN credential in it expires (an hour by default), and a
// reconnect late in a lesson needs a fresh one. The token goes in a header, never in a URL.
async function loadIceServers() {
  const resp = await fetch('/api/config', { headers: { Authorization: `Bearer ${token}` } });
  if (!resp.ok) throw new Error(`server config unavailable (HTTP ${resp.status})`);
  return (await resp.json()).ice_servers || [];
}

function iceGatheringDone(pc, timeoutMs) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === 'complete') return resolve();
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener('icegatheringstatechange', onChange);
      resolve();
    };
    const onChange = () => { if (pc.iceGatheringState === 'complete') done(); };
    // A slow or unreachable STUN/TURN server can hold gathering for many seconds; the
    // candidates gathered so far (host ones at least) are usually enough.
    const timer = setTimeout(done, timeoutMs);
    pc.addEventListener('icegatheringstatechange', onChange);
  });
}

class OfferError extends Error {
  constructor(message, status, retryAfterS) {
    super(message);
    this.status = status;
    this.retryAfterS = retryAfterS;
  }
  // Network trouble, a server error or a full room (429) may pass; a bad token or room won't.
  get retryable() { return !this.status || this.status >= 500 || this.status === 429 || this.status === 408; }
}

const OFFER_TIMEOUT_MS = 10000; // a network that drops everything would hold a fetch for minutes

async function postOffer(s, description) {
  let resp;
  try {
    resp = await fetch(`/api/rooms/${encodeURIComponent(room)}/offer`, {
      method: 'POST',
      signal: AbortSignal.timeout(OFFER_TIMEOUT_MS),
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({
        token, sdp: description.sdp, type: description.type,
        student_name: s.name, ...(s.identity || {}),
        ...(s.keeper ? { recovery: { catch_up: s.catchUpFrom !== null, clock: s.kept.clock } } : {}),
      }),
    });
  } catch (err) {
    throw new OfferError('server unreachable', 0);
  }
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    throw new OfferError(body.error || `HTTP ${resp.status}`, resp.status, Number(resp.headers.get('Retry-After')) || 0);
  }
  return body;
}

async function connect(s) {
  const attempt = ++s.attempt;
  // Anything that awaits may come back after Leave or after a newer attempt took over.
  const stale = () => session !== s || attempt !== s.attempt;
  setStatus(s.connectedOnce ? 'reconnecting… your speech is kept' : 'connecting…', 'connecting');
  try {
    const servers = await loadIceServers();
    if (stale()) return;
    // max-bundle: the audio and the recovery channel share one transport, so the offer names
    // one set of candidates (the server accepts at most 10)
    const pc = new RTCPeerConnection({ iceServers: servers, bundlePolicy: 'max-bundle' });
    s.pc = pc;
    pc.addTransceiver(s.track, { direction: 'sendonly', streams: [s.stream] });
    pc.addEventListener('connectionstatechange', () => { if (!stale()) onConnectionState(s, pc); });
    // Everything since the last ack goes again; before the first ack, all that is kept.
    if (s.keeper) {
      if (s.connectedOnce) s.catchUpFrom = s.ackT ?? s.kept.oldest;
      openRecovery(s, pc, stale);
    }

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringDone(pc, ICE_GATHER_TIMEOUT_MS);
    if (stale()) return;

    const answer = await postOffer(s, pc.localDescription);
    if (stale()) return;
    if (answer.student_id && answer.resume) {
      s.identity = { student_id: answer.student_id, resume: answer.resume };
      sessionStorage.setItem(idKey, JSON.stringify(s.identity));
    }
    s.serverKeeps = answer.recovery === true; // an older server: no acks, no heartbeat, no catch-up
    if (!s.serverKeeps) s.catchUpFrom = null;
    await pc.setRemoteDescription({ type: 'answer', sdp: answer.sdp });
    if (stale()) return;
    s.watchdog = setTimeout(() => {
      if (!stale() && pc.connectionState !== 'connected') retry(s, 'no audio connection');
    }, CONNECT_TIMEOUT_MS);
  } catch (err) {
    if (stale()) return;
    if (err instanceof OfferError && !err.retryable) {
      stop(s, `Could not join: ${err.message}`, 'error');
    } else {
      retry(s, err.message, err.retryAfterS);
    }
  }
}

function onConnectionState(s, pc) {
  switch (pc.connectionState) {
    case 'connected':
      clearTimeout(s.disconnectTimer);
      clearTimeout(s.watchdog);
      s.failures = 0;
      s.connectedOnce = true;
      if (!s.catchingUp) setStatus('connected — speak', 'connected');
      break;
    case 'disconnected':
      setStatus('weak network — holding on… your speech is kept', 'unstable');
      clearTimeout(s.disconnectTimer);
      s.disconnectTimer = setTimeout(() => {
        if (pc.connectionState === 'disconnected') retry(s, 'connection lost');
      }, DISCONNECT_GRACE_MS);
      break;
    case 'failed':
      retry(s, 'connection failed');
      break;
  }
}

function closePeer(s) {
  clearTimeout(s.disconnectTimer);
  clearTimeout(s.watchdog);
  clearTimeout(s.markTimer);
  clearInterval(s.heartbeatTimer);
  s.channel = null;
  if (s.pc) s.pc.close(); // closes the transport only; the microphone track stays live
  s.pc = null;
}

// Tear down the current peer connection and try again later with a new one (retry.js: a jittered
// wait that doubles with each failed attempt; the server's Retry-After at least).
function retry(s, reason, retryAfterS = 0) {
  if (session !== s || s.retryTimer) return;
  s.attempt++; // an attempt still in flight is now stale
  closePeer(s);
  const delayS = Math.min(reconnectWaitS(s.failures++, retryAfterS), 60);
  setStatus(`reconnecting… your speech is kept (${reason}; next try in ${Math.ceil(delayS)} s)`, 'reconnecting');
  s.retryTimer = setTimeout(() => {
    s.retryTimer = null;
    connect(s);
  }, delayS * 1000);
}

// --- join / leave ------------------------------------------------------------------------

async function join(event) {
  event.preventDefault();
  if (session) return;
  const name = nameInput.value.trim();
  if (!name) {
    setStatus('Please enter your name.', 'error');
    nameInput.focus();
    return;
  }
  if (!navigator.mediaDevices?.getUserMedia) {
    setStatus('This page needs a secure address (https:// or localhost) to use the microphone.', 'error');
    return;
  }
  sessionStorage.setItem('streamserver:name', name);

  const s = {
    name, identity: savedIdentity(), attempt: 0, failures: 0, connectedOnce: false,
    pc: null, stream: null, track: null, meterFrame: 0,
    retryTimer: null, disconnectTimer: null, watchdog: null, markTimer: null, heartbeatTimer: null,
    kept: new KeptAudio(), keeper: null, channel: null, serverKeeps: false, acks: new AckWatch(),
    ackT: null, catchUpFrom: null, catchingUp: false,
    // Created inside the click so the autoplay policy lets it run.
    audioCtx: new AudioContext(),
  };
  session = s;
  setBusy(true);
  setStatus('asking for the microphone…', 'connecting');

  try {
    s.stream = await navigator.mediaDevices.getUserMedia({ audio: AUDIO_CONSTRAINTS });
  } catch (err) {
    const why = err.name === 'NotAllowedError' ? 'permission was denied'
      : err.name === 'NotFoundError' ? 'no microphone was found' : err.message;
    stop(s, `Microphone unavailable: ${why}.`, 'error');
    return;
  }
  if (session !== s) { // Leave was pressed while the permission prompt was open
    s.stream.getTracks().forEach((t) => t.stop());
    return;
  }
  s.track = s.stream.getAudioTracks()[0];
  s.track.addEventListener('ended', () => stop(s, 'The microphone stopped (unplugged or blocked). Press Join to start again.', 'error'));
  s.audioCtx.resume();
  startMeter(s);
  try {
    await startKeeping(s);
  } catch (err) { // without an AudioWorklet the page still works, it just keeps nothing
    console.warn('the microphone audio is not kept:', err);
  }
  if (session !== s) return;
  connect(s);
}

function stop(s, message, state) {
  if (session !== s) return;
  // A goodbye: the server flushes the last speech at once instead of keeping it for a reconnect
  // (the peer closes a moment later, so that the goodbye gets out first).
  const bye = s.channel?.readyState === 'open';
  if (bye) s.channel.send(JSON.stringify({ type: 'bye' }));
  session = null;
  clearTimeout(s.retryTimer);
  if (bye) setTimeout(() => closePeer(s), 250); else closePeer(s);
  cancelAnimationFrame(s.meterFrame);
  s.stream?.getTracks().forEach((t) => t.stop());
  s.audioCtx.close();
  resetMeter();
  setBusy(false);
  setStatus(message, state);
}

function setBusy(busy) {
  joinButton.disabled = busy;
  nameInput.disabled = busy;
  leaveButton.disabled = !busy;
}

// --- page setup --------------------------------------------------------------------------

$('room').textContent = room || '–';
nameInput.value = param('name') || sessionStorage.getItem('streamserver:name') || '';
form.addEventListener('submit', join);
leaveButton.addEventListener('click', () => session && stop(session, 'You left the class.', 'idle'));
// Closing the tab: close the peer connection so the server sees the student leave at once.
window.addEventListener('pagehide', () => session && stop(session, 'You left the class.', 'idle'));

if (!room || !token) {
  setStatus('This link is missing the room or the token: ask your teacher for the class link.', 'error');
  joinButton.disabled = true;
}
