// The student's microphone at 16 kHz mono for the page to keep (student.js, KeptAudio): low-passed
// at 7 kHz (a 33-tap windowed sinc) and decimated from the device's rate, in 20 ms pieces.
'use strict';
class Keeper extends AudioWorkletProcessor {
  constructor() {
    super();
    const taps = 33, cutoff = 7000 / sampleRate;
    this.h = new Float32Array(taps);
    let sum = 0;
    for (let i = 0; i < taps; i++) {
      const x = i - (taps - 1) / 2;
      const sinc = x === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * x) / (Math.PI * x);
      this.h[i] = sinc * (0.54 - 0.46 * Math.cos(2 * Math.PI * i / (taps - 1)));
      sum += this.h[i];
    }
    for (let i = 0; i < taps; i++) this.h[i] /= sum;
    this.hist = new Float32Array(taps);
    this.at = 0;
    this.seen = 0;
    this.next = 0;
    this.step = sampleRate / 16000;
    this.out = new Float32Array(320);
    this.fill = 0;
  }
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    const frames = ch ? ch.length : 128; // no input yet: silence keeps the clock going
    const L = this.hist.length;
    for (let i = 0; i < frames; i++) {
      this.hist[this.at] = ch ? ch[i] : 0;
      this.at = (this.at + 1) % L;
      this.seen++;
      while (this.next < this.seen) {
        let acc = 0;
        for (let k = 0; k < L; k++) acc += this.h[k] * this.hist[(this.at + k) % L];
        this.out[this.fill++] = acc;
        if (this.fill === this.out.length) { this.port.postMessage(this.out.slice(0)); this.fill = 0; }
        this.next += this.step;
      }
    }
    return true;
  }
}
registerProcessor('keeper', Keeper);
